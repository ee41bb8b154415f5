// Package nomadconfig turns a Nomad plugin's config, given as a JSON object, into the
// MessagePack bytes the plugin's SetConfig expects, the way a Nomad client does: the
// plugin's ConfigSchema (an hclspec.Spec) becomes an HCL decoder spec, the JSON object is
// read as an HCL JSON body and decoded with it (defaults filled, types converted,
// unknown or missing keys refused), and the resulting value is MessagePack-encoded with
// its type.
//
// The functions are pure and safe for concurrent use.
package nomadconfig

import (
	"errors"
	"fmt"
	"strings"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/ext/typeexpr"
	"github.com/hashicorp/hcl/v2/hcldec"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	hcljson "github.com/hashicorp/hcl/v2/json"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
	"github.com/zclconf/go-cty/cty"
	"github.com/zclconf/go-cty/cty/function"
	"github.com/zclconf/go-cty/cty/function/stdlib"
	"github.com/zclconf/go-cty/cty/msgpack"
)

// MaxConfigLen bounds, in bytes, a config given to Encode.
const MaxConfigLen = 1 << 20

// specFunctions are the functions a schema's Literal values may call, as the hclspec
// documentation lists them.
var specFunctions = map[string]function.Function{
	"abs":        stdlib.AbsoluteFunc,
	"coalesce":   stdlib.CoalesceFunc,
	"concat":     stdlib.ConcatFunc,
	"hasindex":   stdlib.HasIndexFunc,
	"int":        stdlib.IntFunc,
	"jsondecode": stdlib.JSONDecodeFunc,
	"jsonencode": stdlib.JSONEncodeFunc,
	"length":     stdlib.LengthFunc,
	"lower":      stdlib.LowerFunc,
	"max":        stdlib.MaxFunc,
	"min":        stdlib.MinFunc,
	"reverse":    stdlib.ReverseFunc,
	"strlen":     stdlib.StrlenFunc,
	"substr":     stdlib.SubstrFunc,
	"upper":      stdlib.UpperFunc,
}

var evalCtx = &hcl.EvalContext{Functions: specFunctions}

// Encode decodes configJSON (a JSON object; empty or "null" means {}) with schema and
// returns the MessagePack encoding of the result, which is what a Nomad plugin's
// SetConfig takes. A nil schema means the plugin takes no config: Encode then returns
// nil, and an error if configJSON holds any key. The error names each key that is
// wrong and why.
func Encode(schema *hclspec.Spec, configJSON []byte) ([]byte, error) {
	if len(configJSON) > MaxConfigLen {
		return nil, fmt.Errorf("config is %d bytes, more than %d", len(configJSON), MaxConfigLen)
	}
	body := strings.TrimSpace(string(configJSON))
	if body == "" || body == "null" {
		body = "{}"
	}
	if schema == nil {
		if body != "{}" {
			return nil, errors.New("the plugin takes no config, but one was given")
		}
		return nil, nil
	}
	spec, err := Spec(schema)
	if err != nil {
		return nil, fmt.Errorf("the plugin's config schema: %w", err)
	}
	file, diags := hcljson.Parse([]byte(body), "config")
	if diags.HasErrors() {
		return nil, diagError(diags)
	}
	val, diags := hcldec.Decode(file.Body, spec, evalCtx)
	if diags.HasErrors() {
		return nil, diagError(diags)
	}
	out, err := msgpack.Marshal(val, val.Type())
	if err != nil {
		return nil, fmt.Errorf("encode config as MessagePack: %w", err)
	}
	return out, nil
}

// Spec converts an hclspec.Spec (what a Nomad plugin's ConfigSchema returns) to the
// HCL decoder spec it describes.
func Spec(s *hclspec.Spec) (hcldec.Spec, error) {
	return convert(s, "", 0)
}

// maxDepth bounds the nesting of a schema: a plugin is untrusted, and its schema is
// walked recursively.
const maxDepth = 32

// convert converts s; name is the key of s in its parent Object, which Attr and block
// specs use when they carry no name of their own.
func convert(s *hclspec.Spec, name string, depth int) (hcldec.Spec, error) {
	if s == nil {
		return nil, errors.New("empty spec")
	}
	if depth > maxDepth {
		return nil, fmt.Errorf("nested more than %d deep", maxDepth)
	}
	depth++
	switch b := s.GetBlock().(type) {
	case *hclspec.Spec_Object:
		obj := hcldec.ObjectSpec{}
		for key, sub := range b.Object.GetAttributes() {
			c, err := convert(sub, key, depth)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", key, err)
			}
			obj[key] = c
		}
		return obj, nil
	case *hclspec.Spec_Array:
		tuple := hcldec.TupleSpec{}
		for i, sub := range b.Array.GetValues() {
			c, err := convert(sub, "", depth)
			if err != nil {
				return nil, fmt.Errorf("[%d]: %w", i, err)
			}
			tuple = append(tuple, c)
		}
		return tuple, nil
	case *hclspec.Spec_Attr:
		ty, err := typeOf(b.Attr.GetType())
		if err != nil {
			return nil, err
		}
		n, err := pick(b.Attr.GetName(), name, "attribute")
		if err != nil {
			return nil, err
		}
		return &hcldec.AttrSpec{Name: n, Type: ty, Required: b.Attr.GetRequired()}, nil
	case *hclspec.Spec_BlockValue:
		n, err := pick(b.BlockValue.GetName(), name, "block")
		if err != nil {
			return nil, err
		}
		nested, err := convert(b.BlockValue.GetNested(), "", depth)
		if err != nil {
			return nil, fmt.Errorf("block %s: %w", n, err)
		}
		return &hcldec.BlockSpec{TypeName: n, Nested: nested, Required: b.BlockValue.GetRequired()}, nil
	case *hclspec.Spec_BlockAttrs:
		ty, err := typeOf(b.BlockAttrs.GetType())
		if err != nil {
			return nil, err
		}
		n, err := pick(b.BlockAttrs.GetName(), name, "block_attrs")
		if err != nil {
			return nil, err
		}
		return &hcldec.BlockAttrsSpec{TypeName: n, ElementType: ty, Required: b.BlockAttrs.GetRequired()}, nil
	case *hclspec.Spec_BlockList:
		n, err := pick(b.BlockList.GetName(), name, "block_list")
		if err != nil {
			return nil, err
		}
		nested, err := convert(b.BlockList.GetNested(), "", depth)
		if err != nil {
			return nil, fmt.Errorf("block list %s: %w", n, err)
		}
		lo, hi, err := limits(b.BlockList.GetMinItems(), b.BlockList.GetMaxItems())
		if err != nil {
			return nil, fmt.Errorf("block list %s: %w", n, err)
		}
		return &hcldec.BlockListSpec{TypeName: n, Nested: nested, MinItems: lo, MaxItems: hi}, nil
	case *hclspec.Spec_BlockSet:
		n, err := pick(b.BlockSet.GetName(), name, "block_set")
		if err != nil {
			return nil, err
		}
		nested, err := convert(b.BlockSet.GetNested(), "", depth)
		if err != nil {
			return nil, fmt.Errorf("block set %s: %w", n, err)
		}
		lo, hi, err := limits(b.BlockSet.GetMinItems(), b.BlockSet.GetMaxItems())
		if err != nil {
			return nil, fmt.Errorf("block set %s: %w", n, err)
		}
		return &hcldec.BlockSetSpec{TypeName: n, Nested: nested, MinItems: lo, MaxItems: hi}, nil
	case *hclspec.Spec_BlockMap:
		n, err := pick(b.BlockMap.GetName(), name, "block_map")
		if err != nil {
			return nil, err
		}
		if len(b.BlockMap.GetLabels()) == 0 {
			return nil, fmt.Errorf("block map %s: no labels", n)
		}
		nested, err := convert(b.BlockMap.GetNested(), "", depth)
		if err != nil {
			return nil, fmt.Errorf("block map %s: %w", n, err)
		}
		return &hcldec.BlockMapSpec{TypeName: n, LabelNames: b.BlockMap.GetLabels(), Nested: nested}, nil
	case *hclspec.Spec_Default:
		// The primary gets the parent's key too: Default { Attr {...} } under an Object
		// key may leave the Attr unnamed.
		primary, err := convert(b.Default.GetPrimary(), name, depth)
		if err != nil {
			return nil, err
		}
		def, err := convert(b.Default.GetDefault(), name, depth)
		if err != nil {
			return nil, fmt.Errorf("default: %w", err)
		}
		return &hcldec.DefaultSpec{Primary: primary, Default: def}, nil
	case *hclspec.Spec_Literal:
		v, err := literal(b.Literal.GetValue())
		if err != nil {
			return nil, err
		}
		return &hcldec.LiteralSpec{Value: v}, nil
	default:
		return nil, fmt.Errorf("unknown spec kind %T", b)
	}
}

// pick returns own, or else the key the spec has in its parent object.
func pick(own, key, kind string) (string, error) {
	if own != "" {
		return own, nil
	}
	if key != "" {
		return key, nil
	}
	return "", fmt.Errorf("%s spec without a name", kind)
}

// limits converts a block list's or set's item bounds.
func limits(lo, hi uint64) (int, int, error) {
	const most = 1 << 20
	if lo > most || hi > most {
		return 0, 0, fmt.Errorf("item limits %d..%d over %d", lo, hi, most)
	}
	if hi > 0 && lo > hi {
		return 0, 0, fmt.Errorf("min_items %d over max_items %d", lo, hi)
	}
	return int(lo), int(hi), nil
}

// typeOf reads a type expression ("string", "list(number)", "any"...); empty means any.
func typeOf(expr string) (cty.Type, error) {
	if strings.TrimSpace(expr) == "" {
		return cty.DynamicPseudoType, nil
	}
	e, diags := hclsyntax.ParseExpression([]byte(expr), "type", hcl.InitialPos)
	if diags.HasErrors() {
		return cty.NilType, fmt.Errorf("type %q: %w", expr, diagError(diags))
	}
	ty, diags := typeexpr.TypeConstraint(e)
	if diags.HasErrors() {
		return cty.NilType, fmt.Errorf("type %q: %w", expr, diagError(diags))
	}
	return ty, nil
}

// literal evaluates a Literal's HCL expression (e.g. `"5s"`, `["a"]`, `upper("x")`).
func literal(expr string) (cty.Value, error) {
	e, diags := hclsyntax.ParseExpression([]byte(expr), "literal", hcl.InitialPos)
	if diags.HasErrors() {
		return cty.NilVal, fmt.Errorf("literal %q: %w", expr, diagError(diags))
	}
	v, diags := e.Value(evalCtx)
	if diags.HasErrors() {
		return cty.NilVal, fmt.Errorf("literal %q: %w", expr, diagError(diags))
	}
	return v, nil
}

// diagError joins the error diagnostics into one error, one per line: summary, detail,
// and where in the config.
func diagError(diags hcl.Diagnostics) error {
	var errs []error
	for _, d := range diags {
		if d.Severity != hcl.DiagError {
			continue
		}
		msg := d.Summary
		if d.Detail != "" {
			msg += ": " + d.Detail
		}
		errs = append(errs, errors.New(msg))
	}
	return errors.Join(errs...)
}
