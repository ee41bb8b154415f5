package nomadconfig_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/device/cmd/example"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"

	"github.com/devicehost/devicehost/integrations/nomad/nomadconfig"
)

// exampleSchema is the config schema of Nomad's example device plugin: dir,
// list_period and unhealthy_perm, each with a default.
func exampleSchema(t *testing.T) *hclspec.Spec {
	t.Helper()
	s, err := example.NewExampleDevice(hclog.NewNullLogger()).ConfigSchema()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// The example plugin decodes what Encode makes exactly as it decodes what a Nomad
// client sends: its defaults where the config has nothing, the given values otherwise.
func TestEncodeExampleSchema(t *testing.T) {
	for _, tc := range []struct {
		name, config string
		want         example.Config
	}{
		{"empty", ``, example.Config{Dir: ".", ListPeriod: "5s", UnhealthyPerm: "-rwxrwxrwx"}},
		{"null", `null`, example.Config{Dir: ".", ListPeriod: "5s", UnhealthyPerm: "-rwxrwxrwx"}},
		{"some", `{"dir": "/dev/fake", "list_period": "100ms"}`, example.Config{Dir: "/dev/fake", ListPeriod: "100ms", UnhealthyPerm: "-rwxrwxrwx"}},
		{"number as string", `{"list_period": 5}`, example.Config{Dir: ".", ListPeriod: "5", UnhealthyPerm: "-rwxrwxrwx"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			packed, err := nomadconfig.Encode(exampleSchema(t), []byte(tc.config))
			if err != nil {
				t.Fatal(err)
			}
			var got example.Config
			if err := base.MsgPackDecode(packed, &got); err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("decoded %+v, want %+v", got, tc.want)
			}
		})
	}
}

// What the schema refuses is an error that names the key and the problem.
func TestEncodeRefuses(t *testing.T) {
	required := hclspec.NewObject(map[string]*hclspec.Spec{
		"name": hclspec.NewAttr("name", "string", true),
	})
	for _, tc := range []struct {
		name   string
		schema *hclspec.Spec
		config string
		want   []string
	}{
		{"unknown key", nil, `{"dri": "/x"}`, []string{`"dri"`}},
		{"wrong type", nil, `{"dir": ["a", "b"]}`, []string{"dir", "string required"}},
		{"not an object", nil, `["x"]`, []string{"object"}},
		{"not JSON", nil, `{dir = "x"}`, nil},
		{"missing required", required, `{}`, []string{`"name" is required`}},
		{"too large", nil, `{"dir": "` + strings.Repeat("x", nomadconfig.MaxConfigLen) + `"}`, []string{"more than"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			schema := tc.schema
			if schema == nil {
				schema = exampleSchema(t)
			}
			_, err := nomadconfig.Encode(schema, []byte(tc.config))
			if err == nil {
				t.Fatal("Encode accepted it")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %s", err, w)
				}
			}
		})
	}
}

// A plugin without a schema takes no config.
func TestEncodeNoSchema(t *testing.T) {
	if b, err := nomadconfig.Encode(nil, nil); err != nil || b != nil {
		t.Errorf("Encode(nil, nil) = %v, %v; want nil, nil", b, err)
	}
	if b, err := nomadconfig.Encode(nil, []byte(" {} ")); err != nil || b != nil {
		t.Errorf("Encode(nil, {}) = %v, %v; want nil, nil", b, err)
	}
	if _, err := nomadconfig.Encode(nil, []byte(`{"a": 1}`)); err == nil || !strings.Contains(err.Error(), "takes no config") {
		t.Errorf("Encode(nil, {a}) error %v; want takes no config", err)
	}
}

// Every kind of spec Nomad plugins declare decodes as Nomad decodes it: nested
// blocks (written as objects or lists of objects), block lists, sets and maps, block
// attributes, arrays, and literals computed by the documented functions.
func TestEncodeSpecKinds(t *testing.T) {
	schema := hclspec.NewObject(map[string]*hclspec.Spec{
		"ids":   hclspec.NewDefault(hclspec.NewAttr("ids", "list(string)", false), hclspec.NewLiteral(`[]`)),
		"limit": hclspec.NewDefault(hclspec.NewAttr("limit", "number", false), hclspec.NewLiteral(`max(2, 7)`)),
		"mode":  hclspec.NewDefault(hclspec.NewAttr("mode", "string", false), hclspec.NewLiteral(`upper("fast")`)),
		"tls": hclspec.NewBlock("tls", false, hclspec.NewObject(map[string]*hclspec.Spec{
			"ca": hclspec.NewAttr("ca", "string", true),
		})),
		"rule":   hclspec.NewBlockList("rule", hclspec.NewObject(map[string]*hclspec.Spec{"match": hclspec.NewAttr("match", "string", false)})),
		"tag":    hclspec.NewBlockSet("tag", hclspec.NewAttr("v", "string", false)),
		"gpu":    hclspec.NewBlockMap("gpu", []string{"id"}, hclspec.NewObject(map[string]*hclspec.Spec{"mem": hclspec.NewAttr("mem", "number", false)})),
		"labels": hclspec.NewBlockAttrs("labels", "string", false),
		"pair":   hclspec.NewArray([]*hclspec.Spec{hclspec.NewLiteral(`"a"`), hclspec.NewLiteral(`1`)}),
	})
	type tlsCfg struct {
		CA string `codec:"ca"`
	}
	type ruleCfg struct {
		Match string `codec:"match"`
	}
	type gpuCfg struct {
		Mem int `codec:"mem"`
	}
	type cfg struct {
		IDs    []string          `codec:"ids"`
		Limit  int               `codec:"limit"`
		Mode   string            `codec:"mode"`
		TLS    *tlsCfg           `codec:"tls"`
		Rule   []ruleCfg         `codec:"rule"`
		GPU    map[string]gpuCfg `codec:"gpu"`
		Labels map[string]string `codec:"labels"`
		Pair   []any             `codec:"pair"`
	}
	config := `{
		"ids": ["GPU-1"],
		"tls": {"ca": "/ca.pem"},
		"rule": [{"match": "a"}, {"match": "b"}],
		"gpu": {"GPU-1": {"mem": 80}},
		"labels": {"zone": "z1"}
	}`
	packed, err := nomadconfig.Encode(schema, []byte(config))
	if err != nil {
		t.Fatal(err)
	}
	var got cfg
	if err := base.MsgPackDecode(packed, &got); err != nil {
		t.Fatal(err)
	}
	want := cfg{
		IDs: []string{"GPU-1"}, Limit: 7, Mode: "FAST", TLS: &tlsCfg{CA: "/ca.pem"},
		Rule: []ruleCfg{{"a"}, {"b"}}, GPU: map[string]gpuCfg{"GPU-1": {80}},
		Labels: map[string]string{"zone": "z1"}, Pair: []any{"a", int64(1)},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("decoded\n %#v\nwant\n %#v", got, want)
	}
	// A nested block missing its required attribute names it.
	if _, err := nomadconfig.Encode(schema, []byte(`{"tls": {}}`)); err == nil || !strings.Contains(err.Error(), `"ca" is required`) {
		t.Errorf("tls without ca: err %v", err)
	}
}

// A schema that cannot be converted is an error naming where, not a panic: the plugin
// is untrusted.
func TestSpecRefusesBadSchemas(t *testing.T) {
	deep := hclspec.NewAttr("x", "string", false)
	for range 40 {
		deep = hclspec.NewBlock("b", false, deep)
	}
	for _, tc := range []struct {
		name   string
		schema *hclspec.Spec
		want   string
	}{
		{"nil", nil, "empty spec"},
		{"empty", &hclspec.Spec{}, "unknown spec kind"},
		{"bad type", hclspec.NewObject(map[string]*hclspec.Spec{"a": hclspec.NewAttr("a", "strang", false)}), `type "strang"`},
		{"bad literal", hclspec.NewObject(map[string]*hclspec.Spec{"a": hclspec.NewDefault(hclspec.NewAttr("a", "string", false), hclspec.NewLiteral(`nosuch(1)`))}), "literal"},
		{"unnamed attr", hclspec.NewAttr("", "string", false), "without a name"},
		{"block without nested", hclspec.NewObject(map[string]*hclspec.Spec{"b": hclspec.NewBlock("b", false, nil)}), "empty spec"},
		{"block map without labels", hclspec.NewObject(map[string]*hclspec.Spec{"m": hclspec.NewBlockMap("m", nil, hclspec.NewAttr("x", "string", false))}), "no labels"},
		{"limits upside down", hclspec.NewObject(map[string]*hclspec.Spec{"l": hclspec.NewBlockListLimited("l", 3, 1, hclspec.NewAttr("x", "string", false))}), "min_items 3 over max_items 1"},
		{"too deep", deep, "nested more than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := nomadconfig.Spec(tc.schema)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Spec error %v; want one containing %q", err, tc.want)
			}
			if _, err := nomadconfig.Encode(tc.schema, []byte(`{}`)); err == nil && tc.schema != nil {
				t.Fatal("Encode accepted a bad schema")
			}
		})
	}
}
