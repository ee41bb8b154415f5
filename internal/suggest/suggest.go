// Package suggest finds the known name a misspelt one most likely meant, for "did you
// mean" hints. It applies the rule HCL applies to the agent's own config keys (the
// same Levenshtein distance, github.com/agext/levenshtein, and the same bound), so a
// plugin's hint for its config keys and the agent's hint for its own agree.
package suggest

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"github.com/agext/levenshtein"
)

// maxDistance is the largest edit distance a suggestion may be from the given name:
// HCL's (its nameSuggestion takes a distance below 3).
const maxDistance = 2

// Nearest returns the name of known closest to given by edit distance (insertions,
// deletions and substitutions of one character each), or "" when none is within two
// edits or given is itself known. Of names equally close, the first in known wins.
func Nearest(given string, known []string) string {
	best, bestDist := "", maxDistance+1
	for _, k := range known {
		if k == given {
			return ""
		}
		if d := levenshtein.Distance(given, k, nil); d < bestDist {
			best, bestDist = k, d
		}
	}
	return best
}

// UnknownField adds the nearest of known to encoding/json's error for an unknown key
// (`json: unknown field "mgi"`), which names the key but not the one meant:
// `json: unknown field "mgi" (did you mean "mig"?)`. Other errors are returned as they
// are.
func UnknownField(err error, known []string) error {
	quoted, ok := strings.CutPrefix(err.Error(), "json: unknown field ")
	if !ok {
		return err
	}
	name, uerr := strconv.Unquote(quoted)
	if uerr != nil {
		return err
	}
	if s := Nearest(name, known); s != "" {
		return fmt.Errorf("%w (did you mean %q?)", err, s)
	}
	return err
}

// JSONKeys are the JSON key names of the fields of struct v, in field order.
func JSONKeys(v any) []string {
	t := reflect.TypeOf(v)
	keys := make([]string, 0, t.NumField())
	for f := range t.Fields() {
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
			keys = append(keys, name)
		}
	}
	return keys
}
