package dra

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/scheme"
)

// protobufCodec encodes and decodes as client-go's protobuf serializer does.
func protobufCodec(t *testing.T) runtime.Codec {
	t.Helper()
	info, ok := runtime.SerializerInfoForMediaType(scheme.Codecs.SupportedMediaTypes(), runtime.ContentTypeProtobuf)
	if !ok {
		t.Fatal("no protobuf serializer")
	}
	return scheme.Codecs.CodecForVersions(info.Serializer, info.Serializer, resourceapi.SchemeGroupVersion, resourceapi.SchemeGroupVersion)
}

// wireSlices are slices to write: each of a pool's slices (devices of one GPU with its
// MIG partitions, one partition held; counter sets), with the metadata of a slice
// the API server has, and one with a field of the spec after the devices.
func wireSlices(t *testing.T) (objs []*resourceapi.ResourceSlice, encs []sliceEnc) {
	t.Helper()
	v := onDemandView(t, 3, holdPartition(1))
	for i, s := range v.slices {
		obj := &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: "00000-gpu.devicehost.io-node-a-x", ResourceVersion: "1234", UID: "uid-1",
				Labels: map[string]string{"team": "gpu-ops"}, OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: testNode, UID: "node-uid-1"}}},
			Spec: resourceapi.ResourceSliceSpec{Driver: testDriver, NodeName: new(testNode),
				Pool:    resourceapi.ResourcePool{Name: testNode, Generation: 3, ResourceSliceCount: int64(len(v.slices))},
				Devices: s.Devices, SharedCounters: s.SharedCounters, PerDeviceNodeSelection: s.PerDeviceNodeSelection},
		}
		if i == 1 {
			obj.Spec.PerDeviceNodeSelection = new(false) // field 7, after the devices
		}
		objs, encs = append(objs, obj), append(encs, v.encs[i])
	}
	return objs, encs
}

// sliceBody writes what client-go's protobuf serializer writes, byte for byte, with the
// devices' encodings given, some of them, or none.
func TestSliceBodyIsWhatClientGoWrites(t *testing.T) {
	codec := protobufCodec(t)
	objs, encs := wireSlices(t)
	for i, obj := range objs {
		want, err := runtime.Encode(codec, obj)
		if err != nil {
			t.Fatal(err)
		}
		some := make([][]byte, len(encs[i].devs))
		for j := range some {
			if j%2 == 0 {
				some[j] = encs[i].devs[j]
			}
		}
		for name, devs := range map[string][][]byte{"all given": encs[i].devs, "every other given": some, "none given": nil} {
			got, written, err := sliceBody(obj, devs)
			if err != nil {
				t.Fatalf("slice %d, %s: %v", i, name, err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("slice %d, %s: %d bytes, not client-go's %d", i, name, len(got), len(want))
			}
			if len(written) != len(obj.Spec.Devices) {
				t.Fatalf("slice %d, %s: %d devices written, want %d", i, name, len(written), len(obj.Spec.Devices))
			}
			for j := range written {
				if enc, _ := obj.Spec.Devices[j].Marshal(); !bytes.Equal(written[j], enc) {
					t.Errorf("slice %d, %s: device %d written as other bytes than its encoding", i, name, j)
				}
			}
		}
	}
}

// readSlice gives what decoding the whole answer gives, the devices stored as sent
// being the ones sent, and says which those are: a device whose taint the API server
// gave a time, and one it changed, are decoded.
func TestReadSliceDecodesTheAnswer(t *testing.T) {
	codec := protobufCodec(t)
	objs, encs := wireSlices(t)
	for i, sent := range objs {
		_, written, err := sliceBody(sent, encs[i].devs)
		if err != nil {
			t.Fatal(err)
		}
		stored := sent.DeepCopy()
		stored.ResourceVersion, stored.Generation = "1300", 4
		stored.CreationTimestamp = metav1.NewTime(time.Unix(1800000000, 0))
		stored.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "devicehost-dra-plugin", Operation: metav1.ManagedFieldsOperationUpdate}}
		changed := map[int]bool{}
		for j := range stored.Spec.Devices {
			d := &stored.Spec.Devices[j]
			if len(d.Taints) > 0 {
				d.Taints[0].TimeAdded = new(metav1.NewTime(time.Unix(1800000001, 0)))
				changed[j] = true
			}
		}
		if n := len(stored.Spec.Devices); n > 0 {
			stored.Spec.Devices[n-1].Attributes["added"] = resourceapi.DeviceAttribute{StringValue: new("by a webhook")}
			changed[n-1] = true
		}
		answer, err := runtime.Encode(codec, stored)
		if err != nil {
			t.Fatal(err)
		}
		want := &resourceapi.ResourceSlice{}
		if err := runtime.DecodeInto(codec, answer, want); err != nil {
			t.Fatal(err)
		}
		want.TypeMeta = metav1.TypeMeta{}
		got, same, err := readSlice(answer, sent, written)
		if err != nil {
			t.Fatalf("slice %d: %v", i, err)
		}
		if !apiequality.Semantic.DeepEqual(got, want) {
			t.Errorf("slice %d: read\n%+v\nwant\n%+v", i, got, want)
		}
		if len(same) != len(want.Spec.Devices) {
			t.Fatalf("slice %d: %d devices said stored as sent or not, want %d", i, len(same), len(want.Spec.Devices))
		}
		for j := range same {
			if same[j] == changed[j] {
				t.Errorf("slice %d, device %d: stored as sent %v, changed by the server %v", i, j, same[j], changed[j])
			}
			if shared := reflect.ValueOf(got.Spec.Devices[j].Attributes).UnsafePointer() == reflect.ValueOf(sent.Spec.Devices[j].Attributes).UnsafePointer(); shared != same[j] {
				t.Errorf("slice %d, device %d: stored as sent %v, the sent device's attributes %v", i, j, same[j], shared)
			}
		}
	}
}

// An answer whose slice is cut short or has bytes changed is refused where decoding
// it whole is, and read as decoding it whole reads it where not; an answer of another
// kind is refused, and one in JSON is errNotProtobuf.
func TestReadSliceRefusesWhatTheDecoderRefuses(t *testing.T) {
	codec := protobufCodec(t)
	objs, encs := wireSlices(t)
	sent := objs[len(objs)-1]
	_, written, err := sliceBody(sent, encs[len(objs)-1].devs)
	if err != nil {
		t.Fatal(err)
	}
	answer, err := runtime.Encode(codec, sent)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := field(answer[len(k8sProtobufPrefix):], fieldUnknownRaw, "the answer")
	if err != nil {
		t.Fatal(err)
	}
	wrap := func(tm runtime.TypeMeta, raw []byte) []byte {
		unk := runtime.Unknown{TypeMeta: tm, Raw: raw}
		b, err := unk.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return append(bytes.Clone(k8sProtobufPrefix), b...)
	}
	kind := runtime.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceSlice"}
	if b := wrap(kind, raw); !bytes.Equal(b, answer) {
		t.Fatal("the test's envelope is not client-go's")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	check := func(what string, b []byte) {
		t.Helper()
		want := &resourceapi.ResourceSlice{}
		wantErr := runtime.DecodeInto(codec, b, want)
		want.TypeMeta = metav1.TypeMeta{}
		got, _, err := readSlice(b, sent, written)
		switch {
		case (err == nil) != (wantErr == nil):
			t.Errorf("%s: read error %v, the decoder's %v", what, err, wantErr)
		case err == nil && !apiequality.Semantic.DeepEqual(got, want):
			t.Errorf("%s: read other than the decoder's", what)
		}
	}
	for cut := 0; cut < len(raw); cut += 1 + rng.IntN(5) {
		check("cut", wrap(kind, raw[:cut]))
	}
	for range 1000 {
		b := bytes.Clone(raw)
		b[rng.IntN(len(b))] = byte(rng.Uint32())
		check("a byte changed", wrap(kind, b))
	}
	if _, _, err := readSlice(wrap(runtime.TypeMeta{APIVersion: "v1", Kind: "Node"}, raw), sent, written); err == nil {
		t.Error("an answer of kind Node: read as a slice")
	}
	if _, _, err := readSlice([]byte(`{"kind":"ResourceSlice"}`), sent, written); !errors.Is(err, errNotProtobuf) {
		t.Errorf("a JSON answer: %v, want errNotProtobuf", err)
	}
}

// field returns the contents of the last field num (of the bytes type) of message b.
func field(b []byte, num protowire.Number, what string) ([]byte, error) {
	var out []byte
	err := eachField(b, what, func(n protowire.Number, contents, _ []byte) error {
		if n == num && contents != nil {
			out = contents
		}
		return nil
	})
	if err == nil && out == nil {
		err = fmt.Errorf("%s: no field %d", what, num)
	}
	return out, err
}
