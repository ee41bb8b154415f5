package archcheck

import (
	"bufio"
	"fmt"
	"go/ast"
	"go/build/constraint"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// modulePath is the root module's path; the other two modules nest under it, so a
// devicehost import path is modulePath + "/" + the package's folder.
const modulePath = "github.com/devicehost/devicehost"

// row is one line of the import table.
type row struct {
	line    int      // in docs/architecture.md
	pattern string   // "manager", or "tools/..." for a folder and those under it
	imports []string // devicehost packages (patterns) it may import; nil with anyRepo
	anyRepo bool     // "any": every row above it
	outside []string // import-path patterns allowed from outside the standard library
	anyOut  bool     // "any": everything outside but k8s.io and Nomad outside integrations/ and e2e/
}

// pkg is one package of the repository as its files' imports say.
type pkg struct {
	dir     string          // folder relative to the repository root
	test    bool            // only _test.go files (no row needed beyond its folder's)
	imports map[string]bool // of its non-test files
}

func TestImportTable(t *testing.T) {
	root := repoRoot(t)
	rows := readTable(t, filepath.Join(root, "docs", "architecture.md"))
	pkgs := readPackages(t, root)

	rowOf := func(dir string) int {
		best, bestLen := -1, -1
		for i, r := range rows {
			if r.pattern == dir {
				return i
			}
			if base, ok := strings.CutSuffix(r.pattern, "/..."); ok && strings.HasPrefix(dir, base+"/") && len(base) > bestLen {
				best, bestLen = i, len(base)
			}
		}
		return best
	}
	// rowOfImport finds the row of a devicehost import path, or -1.
	rowOfImport := func(path string) int {
		if path == modulePath {
			return -1
		}
		return rowOf(strings.TrimPrefix(path, modulePath+"/"))
	}

	used := make(map[int]bool) // rows some package falls in
	usedImport := make(map[[2]int]bool)
	for _, p := range sortedPackages(pkgs) {
		i := rowOf(p.dir)
		if i < 0 {
			t.Errorf("package %s has no row in docs/architecture.md's import table", p.dir)
			continue
		}
		used[i] = true
		r := rows[i]
		for _, imp := range sortedKeys(p.imports) {
			switch {
			case imp == modulePath || strings.HasPrefix(imp, modulePath+"/"):
				dep := strings.TrimPrefix(imp, modulePath+"/")
				j := rowOfImport(imp)
				if j < 0 {
					t.Errorf("%s imports %s, which has no row in the import table", p.dir, dep)
					continue
				}
				if helper(dep) && !helper(p.dir) && !strings.HasPrefix(p.dir, "tools/") {
					t.Errorf("%s (not a test) imports the test helper %s", p.dir, dep)
				}
				if j == i {
					continue // a package of the same "/..." row
				}
				if j > i {
					t.Errorf("%s imports %s, a floor above its own (line %d imports line %d): an arrow back up", p.dir, dep, r.line, rows[j].line)
					continue
				}
				if r.anyRepo {
					continue
				}
				k := slices.IndexFunc(r.imports, func(s string) bool { return rowOf(s) == j || s == dep })
				if k < 0 {
					t.Errorf("%s imports %s, which its row (docs/architecture.md:%d) does not list", p.dir, dep, r.line)
					continue
				}
				usedImport[[2]int{i, k}] = true
			case !strings.Contains(strings.SplitN(imp, "/", 2)[0], "."):
				// the standard library
			default:
				if err := outsideAllowed(r, p.dir, imp); err != nil {
					t.Errorf("%s imports %s: %v (docs/architecture.md:%d)", p.dir, imp, err, r.line)
				}
			}
		}
	}
	t.Logf("the import drawing of non-test code has %d floors", floors(pkgs))
	for i, r := range rows {
		if !used[i] {
			t.Errorf("docs/architecture.md:%d: row %s names no package of the repository", r.line, r.pattern)
			continue
		}
		for k, imp := range r.imports {
			j := rowOf(imp)
			switch {
			case j < 0:
				t.Errorf("docs/architecture.md:%d: row %s may import %s, which has no row", r.line, r.pattern, imp)
			case j >= i:
				t.Errorf("docs/architecture.md:%d: row %s may import %s, a row at or below it in the table (line %d): rows are floors, bottom first",
					r.line, r.pattern, imp, rows[j].line)
			case !usedImport[[2]int{i, k}]:
				t.Errorf("docs/architecture.md:%d: row %s lists %s, which none of its packages imports: keep the table true", r.line, r.pattern, imp)
			}
		}
	}
}

// floors is the length of the longest chain of devicehost imports among the packages'
// non-test code, counting the package at the bottom as floor 1.
func floors(pkgs map[string]*pkg) int {
	depth := make(map[string]int)
	var visit func(dir string, seen int) int
	visit = func(dir string, seen int) int {
		if d, ok := depth[dir]; ok || seen > len(pkgs) {
			return d
		}
		d := 1
		if p := pkgs[dir]; p != nil {
			for imp := range p.imports {
				if dep, ok := strings.CutPrefix(imp, modulePath+"/"); ok {
					d = max(d, 1+visit(dep, seen+1))
				}
			}
		}
		depth[dir] = d
		return d
	}
	most := 0
	for dir := range pkgs {
		most = max(most, visit(dir, 0))
	}
	return most
}

// helper reports whether a devicehost package is a test helper: a fake, a stand-in or
// a fixture, which production code never imports.
func helper(dir string) bool {
	return strings.HasSuffix(filepath.Base(dir), "test") || strings.HasPrefix(dir, "tools/")
}

// outsideAllowed says why a row may not import path from outside the repository, or
// returns nil if it may.
func outsideAllowed(r row, dir, path string) error {
	if r.anyOut {
		integration := strings.HasPrefix(dir, "integrations/") || strings.HasPrefix(dir, "e2e/")
		if !integration && (strings.HasPrefix(path, "k8s.io/") || strings.HasPrefix(path, "github.com/hashicorp/nomad/")) {
			return fmt.Errorf("Kubernetes and Nomad code belong under integrations/")
		}
		return nil
	}
	for _, o := range r.outside {
		if o == path {
			return nil
		}
		if base, ok := strings.CutSuffix(o, "/..."); ok && (path == base || strings.HasPrefix(path, base+"/")) {
			return nil
		}
	}
	if len(r.outside) == 0 {
		return fmt.Errorf("its row allows the standard library only")
	}
	return fmt.Errorf("its row allows only %s outside the standard library", strings.Join(r.outside, ", "))
}

// readTable parses the import table: the rows of the markdown table whose header is
// "| package | owns | may import (devicehost) | outside the standard library |".
func readTable(t *testing.T, file string) []row {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []row
	in := false
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "| package | owns | may import (devicehost) |") {
			in = true
			continue
		}
		if !in || strings.HasPrefix(line, "|---") {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			if len(rows) > 0 {
				break
			}
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) != 4 {
			t.Fatalf("%s:%d: a row of the import table has %d cells, want 4: %s", file, n, len(cells), line)
		}
		r := row{line: n, pattern: strings.Trim(strings.TrimSpace(cells[0]), "`")}
		r.imports, r.anyRepo = cellList(cells[2])
		r.outside, r.anyOut = cellList(cells[3])
		if r.pattern == "" || strings.ContainsAny(r.pattern, " `") {
			t.Fatalf("%s:%d: the first cell must be one `package`: %s", file, n, line)
		}
		rows = append(rows, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(rows) == 0 {
		t.Fatalf("%s: no import table found", file)
	}
	return rows
}

// cellList reads a cell of backquoted names: "—" for none, "any" for all.
func cellList(cell string) (names []string, any bool) {
	cell = strings.TrimSpace(cell)
	switch cell {
	case "any":
		return nil, true
	case "—", "":
		return nil, false
	}
	for _, s := range strings.Split(cell, ",") {
		names = append(names, strings.Trim(strings.TrimSpace(s), "`"))
	}
	return names, false
}

// readPackages reads the import clauses of every Go file under root (all three
// modules), by folder, honouring no build tags: a file under any tag is code.
func readPackages(t *testing.T, root string) map[string]*pkg {
	t.Helper()
	pkgs := make(map[string]*pkg)
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor" || name == "bin") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			return err
		}
		if ignored(f.Comments, f.Package) {
			return nil
		}
		rel, _ := filepath.Rel(root, filepath.Dir(path))
		rel = filepath.ToSlash(rel)
		p := pkgs[rel]
		if p == nil {
			p = &pkg{dir: rel, test: true, imports: make(map[string]bool)}
			pkgs[rel] = p
		}
		if strings.HasSuffix(path, "_test.go") {
			return nil
		}
		p.test = false
		for _, imp := range f.Imports {
			s, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			p.imports[s] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(pkgs) < 20 {
		t.Fatalf("found %d packages under %s: not the repository", len(pkgs), root)
	}
	return pkgs
}

// ignored reports whether a file's build constraint is "ignore" (a file no build reads).
func ignored(groups []*ast.CommentGroup, pkgPos token.Pos) bool {
	for _, g := range groups {
		if g.Pos() >= pkgPos {
			break
		}
		for _, c := range g.List {
			if !constraint.IsGoBuild(c.Text) {
				continue
			}
			if expr, err := constraint.Parse(c.Text); err == nil && expr.String() == "ignore" {
				return true
			}
		}
	}
	return false
}

func sortedPackages(m map[string]*pkg) []*pkg {
	out := make([]*pkg, 0, len(m))
	for _, k := range sortedKeys(m) {
		out = append(out, m[k])
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// repoRoot is the folder of the root module's go.mod, two floors above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(wd, "..", "..")
	if b, err := os.ReadFile(filepath.Join(root, "go.mod")); err != nil || !strings.Contains(string(b), "module "+modulePath+"\n") {
		t.Fatalf("%s is not the root of module %s (%v)", root, modulePath, err)
	}
	return root
}
