package archcheck

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The README's repository layout table names every top-level folder of the project
// (`name/` in a row's first cell), and its internal/ row every package under internal/:
// a folder added without a word about it fails here.
func TestLayoutTableNamesEveryFolder(t *testing.T) {
	root := filepath.Join("..", "..")
	raw, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, layout, ok := strings.Cut(string(raw), "## Repository layout\n")
	if !ok {
		t.Fatal("README.md has no ## Repository layout section")
	}
	layout, _, _ = strings.Cut(layout, "\n## ")
	firstCells, internalRow := map[string]bool{}, ""
	for _, line := range strings.Split(layout, "\n") {
		rest, ok := strings.CutPrefix(line, "| ")
		if !ok {
			continue
		}
		first, _, _ := strings.Cut(rest, " |")
		for _, f := range strings.Split(first, ",") {
			firstCells[strings.Trim(strings.TrimSpace(f), "`")] = true
		}
		if strings.HasPrefix(rest, "`internal/`") {
			internalRow = rest
		}
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") && e.Name() != ".ci" || e.Name() == "bin" {
			continue
		}
		if !firstCells[e.Name()+"/"] && !hasPrefixKey(firstCells, e.Name()+"/") {
			t.Errorf("README.md's layout table has no row for %s/", e.Name())
		}
	}
	pkgs, err := os.ReadDir(filepath.Join(root, "internal"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pkgs {
		if p.IsDir() && !strings.Contains(internalRow, "`"+p.Name()+"/`") {
			t.Errorf("README.md's internal/ row does not name internal/%s/: %q", p.Name(), internalRow)
		}
	}
}

// hasPrefixKey says whether a key of m starts with prefix (cmd/devicehost/ stands for
// cmd/).
func hasPrefixKey(m map[string]bool, prefix string) bool {
	for k := range m {
		if strings.HasPrefix(k, prefix) {
			return true
		}
	}
	return false
}
