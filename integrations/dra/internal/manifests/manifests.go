// Package manifests decodes the Kubernetes manifests in deploy/kubernetes for the DRA
// module's tests, strictly, as the API server would read them.
package manifests

import (
	"fmt"
	"os"
	"strings"

	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/client-go/kubernetes/scheme"
)

// Read decodes every object of the multi-document YAML file at path, strictly
// (unknown or duplicate fields fail), naming the document that does not decode.
func Read(path string) ([]runtime.Object, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, kjson.SerializerOptions{Yaml: true, Strict: true})
	var out []runtime.Object
	for i, doc := range strings.Split(string(raw), "\n---\n") {
		obj, _, err := dec.Decode([]byte(doc), nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", path, i, err)
		}
		out = append(out, obj)
	}
	return out, nil
}
