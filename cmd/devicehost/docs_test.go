package main

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
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

// schemaKeys is the keys a gohcl-tagged struct type takes: its attributes and blocks
// (not labels, def ranges or the remaining body), and for each block the keys of its
// element type.
func schemaKeys(typ reflect.Type) (keys []string, blocks map[string][]string) {
	blocks = map[string][]string{}
	for i := range typ.NumField() {
		f := typ.Field(i)
		name, kind, _ := strings.Cut(f.Tag.Get("hcl"), ",")
		if name == "" || kind == "label" {
			continue
		}
		keys = append(keys, name)
		if kind == "block" {
			elem := f.Type
			for elem.Kind() == reflect.Slice || elem.Kind() == reflect.Pointer {
				elem = elem.Elem()
			}
			if elem.Kind() == reflect.Struct {
				nested, _ := schemaKeys(elem)
				blocks[name] = nested
			}
		}
	}
	return keys, blocks
}

// docKeys reads the key table of docs/configuration.md: its top-level keys, and for a
// block the keys of its nested rows (or of its inline `{ key = ... }`).
func docKeys(t *testing.T) (keys map[string]bool, blocks map[string]map[string]bool) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(raw), "## Keys\n")
	if !ok {
		t.Fatal("docs/configuration.md has no ## Keys section")
	}
	table, _, _ = strings.Cut(table, "\n\n")
	keys, blocks = map[string]bool{}, map[string]map[string]bool{}
	inline := regexp.MustCompile(`(\w+) =`)
	var block string
	for _, line := range strings.Split(table, "\n") {
		rest, ok := strings.CutPrefix(line, "| ")
		if !ok || strings.HasPrefix(rest, "key ") || strings.HasPrefix(rest, "---") {
			continue
		}
		first, _, _ := strings.Cut(rest, " |")
		nested := strings.HasPrefix(first, "&nbsp;&nbsp;")
		for _, cell := range strings.Split(strings.TrimPrefix(first, "&nbsp;&nbsp;"), ", ") {
			cell = strings.Trim(cell, "`")
			name := strings.FieldsFunc(cell, func(r rune) bool { return r == ' ' || r == '"' })[0]
			switch {
			case nested:
				blocks[block][name] = true
			default:
				keys[name] = true
				if strings.Contains(cell, "{") {
					block = name
					blocks[name] = map[string]bool{}
					for _, m := range inline.FindAllStringSubmatch(cell, -1) {
						blocks[name][m[1]] = true
					}
				}
			}
		}
	}
	return keys, blocks
}

// Every key the agent's config parser knows has a row in docs/configuration.md's key
// table (a block's keys under it), and every row is a key the parser knows: a key added
// or renamed on one side only fails here.
func TestEveryConfigKeyIsDocumented(t *testing.T) {
	keys, blocks := schemaKeys(reflect.TypeFor[fileSchema]())
	docs, docBlocks := docKeys(t)
	for _, k := range keys {
		if !docs[k] {
			t.Errorf("docs/configuration.md has no row for the key %s", k)
		}
	}
	for k := range docs {
		if !slices.Contains(keys, k) {
			t.Errorf("docs/configuration.md documents %s, which the parser does not know", k)
		}
	}
	for b, nested := range blocks {
		for _, k := range nested {
			if !docBlocks[b][k] {
				t.Errorf("docs/configuration.md has no row for %s's key %s", b, k)
			}
		}
		for k := range docBlocks[b] {
			if !slices.Contains(nested, k) {
				t.Errorf("docs/configuration.md documents %s's key %s, which the parser does not know", b, k)
			}
		}
	}
}
