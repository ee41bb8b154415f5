// Package archcheck holds the test that keeps docs/architecture.md's import table true
// for all three modules of the repository: every package in a row, every row a package,
// rows in floor order, and each package's imports within its row. It has no code of its
// own; run it with `go test ./tools/archcheck`. See docs/architecture.md.
package archcheck
