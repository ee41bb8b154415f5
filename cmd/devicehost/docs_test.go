package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every subcommand a user can run has a row in the README's CLI table (its name in
// backquotes in a row's first cell) and a line in `devicehost -h`: a command added
// without its documentation fails here.
func TestEveryCommandIsDocumented(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	inTable := map[string]bool{}
	for _, line := range strings.Split(string(raw), "\n") {
		rest, ok := strings.CutPrefix(line, "| `")
		if !ok {
			continue
		}
		first, _, _ := strings.Cut("`"+rest, " |")
		for _, f := range strings.Split(first, ",") {
			inTable[strings.Trim(strings.TrimSpace(f), "`")] = true
		}
	}
	help := runCLI(t, "-h").stdout
	for _, c := range commands() {
		if c.hidden {
			continue
		}
		if !inTable[c.name] {
			t.Errorf("README.md's CLI table has no row for %s (| `%s` | ...)", c.name, c.name)
		}
		if !strings.Contains(help, "\n  "+c.name+" ") {
			t.Errorf("devicehost -h does not list %s:\n%s", c.name, help)
		}
	}
}
