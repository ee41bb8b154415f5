// Package k8smanifest reads the Kubernetes manifests in deploy/kubernetes for the main
// module's tests (the deploy checks of cmd/devicehost and the real-node suite's
// DaemonSet rendering) without Kubernetes' own types, which stay out of this module:
// the part of an object those tests read, and a reader of multi-document YAML.
package k8smanifest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"
)

// Object is the part of a Kubernetes object the tests read: a ConfigMap's data, a
// Pod's containers, a DaemonSet's pod template. Fields they do not read are ignored.
type Object struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name      string `yaml:"name"`
		Namespace string `yaml:"namespace"`
	} `yaml:"metadata"`
	Data map[string]string `yaml:"data"`
	Spec struct {
		// Pod
		Containers []Container `yaml:"containers"`
		// DaemonSet
		Template struct {
			Spec struct {
				InitContainers []Container `yaml:"initContainers"`
				Containers     []Container `yaml:"containers"`
				Volumes        []Volume    `yaml:"volumes"`
			} `yaml:"spec"`
		} `yaml:"template"`
	} `yaml:"spec"`
}

// Container is the part of a container the tests read.
type Container struct {
	Name    string   `yaml:"name"`
	Command []string `yaml:"command"`
	Args    []string `yaml:"args"`
	Env     []struct {
		Name  string `yaml:"name"`
		Value string `yaml:"value"`
	} `yaml:"env"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
	LivenessProbe *struct {
		Exec struct {
			Command []string `yaml:"command"`
		} `yaml:"exec"`
	} `yaml:"livenessProbe"`
	Resources struct {
		Limits map[string]string `yaml:"limits"`
	} `yaml:"resources"`
}

// Volume is a pod volume: an emptyDir, a hostPath or a ConfigMap.
type Volume struct {
	Name     string    `yaml:"name"`
	EmptyDir *struct{} `yaml:"emptyDir"`
	HostPath *struct {
		Path string `yaml:"path"`
	} `yaml:"hostPath"`
	ConfigMap *struct {
		Name string `yaml:"name"`
	} `yaml:"configMap"`
}

// Read decodes every document of the YAML file at path as an Object.
func Read(path string) ([]Object, error) { return Docs[Object](path) }

// Docs decodes every document of the YAML file at path as a T, in order; a YAML
// error is returned with the path.
func Docs[T any](path string) ([]T, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var out []T
	for {
		var v T
		err := dec.Decode(&v)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, v)
	}
}
