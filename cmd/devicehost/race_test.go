//go:build race

package main

// raceEnabled builds the end-to-end test's devicehost binary with -race too.
const raceEnabled = true
