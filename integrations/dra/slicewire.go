package dra

import (
	"bytes"
	"errors"
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// A ResourceSlice update as bytes on the wire. client-go's typed Update encodes the
// slice's 29 devices (a GPU with on-demand MIG) that the view already holds encoded,
// and decodes the API server's answer whole, devices, attribute maps and quantities,
// to give the slice as stored; on the real node the two were a fifth of the driver's
// CPU per change and a quarter of what it allocated. sliceBody writes each device as
// the view's bytes, and readSlice decodes of the answer only the metadata, the spec's
// other fields and the devices whose bytes are not the ones sent.

// k8sProtobufPrefix starts client-go's (and the API server's) protobuf encoding of an
// object: then a runtime.Unknown holding the object's own encoding.
var k8sProtobufPrefix = []byte{'k', '8', 's', 0}

// Field numbers of the generated messages (k8s.io/api/resource/v1/generated.proto,
// k8s.io/apimachinery/pkg/runtime/generated.proto).
const (
	fieldUnknownTypeMeta        = 1 // runtime.Unknown's typeMeta
	fieldUnknownRaw             = 2 // raw
	fieldUnknownContentEncoding = 3 // contentEncoding
	fieldUnknownContentType     = 4 // and contentType
	fieldSliceMeta              = 1 // ResourceSlice's metadata
	fieldSliceSpec              = 2 // and spec
	fieldSpecDevices            = 6 // ResourceSliceSpec's devices
)

// sliceBody encodes s as client-go's protobuf serializer does (byte for byte), each
// device i whose encoding devs[i] is given (not nil) written as those bytes rather
// than encoded again; written are the devices' encodings as written. s is not changed.
func sliceBody(s *resourceapi.ResourceSlice, devs [][]byte) (body []byte, written [][]byte, err error) {
	meta, err := s.ObjectMeta.Marshal()
	if err != nil {
		return nil, nil, fmt.Errorf("encode the slice's metadata: %w", err)
	}
	bare := s.Spec
	bare.Devices = nil
	rest, err := bare.Marshal()
	if err != nil {
		return nil, nil, fmt.Errorf("encode the slice's spec: %w", err)
	}
	// The spec's fields in their numbers' order, as the generated code writes them:
	// the devices go before the first field numbered after theirs.
	at, off := len(rest), 0
	err = eachField(rest, "the slice's spec as encoded", func(num protowire.Number, _, whole []byte) error {
		if num > fieldSpecDevices && at == len(rest) {
			at = off
		}
		off += len(whole)
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	written = make([][]byte, len(s.Spec.Devices))
	devsLen := 0
	for i := range s.Spec.Devices {
		if i < len(devs) {
			written[i] = devs[i]
		}
		if written[i] == nil {
			if written[i], err = s.Spec.Devices[i].Marshal(); err != nil {
				return nil, nil, fmt.Errorf("encode device %s: %w", s.Spec.Devices[i].Name, err)
			}
		}
		devsLen += protowire.SizeTag(fieldSpecDevices) + protowire.SizeBytes(len(written[i]))
	}
	kind := resourceapi.SchemeGroupVersion.WithKind("ResourceSlice")
	typeMeta, err := (&runtime.TypeMeta{APIVersion: kind.GroupVersion().String(), Kind: kind.Kind}).Marshal()
	if err != nil {
		return nil, nil, fmt.Errorf("encode the slice's kind: %w", err)
	}
	// One buffer of the size it takes: the prefix, then the runtime.Unknown as its
	// generated code writes it (typeMeta, raw, and empty contentEncoding and
	// contentType), raw being the ResourceSlice (metadata, spec).
	specLen := len(rest) + devsLen
	rawLen := protowire.SizeTag(fieldSliceMeta) + protowire.SizeBytes(len(meta)) +
		protowire.SizeTag(fieldSliceSpec) + protowire.SizeBytes(specLen)
	size := len(k8sProtobufPrefix) + protowire.SizeTag(fieldUnknownTypeMeta) + protowire.SizeBytes(len(typeMeta)) +
		protowire.SizeTag(fieldUnknownRaw) + protowire.SizeBytes(rawLen) + 2*(protowire.SizeTag(fieldUnknownContentType)+1)
	out := make([]byte, 0, size)
	out = append(out, k8sProtobufPrefix...)
	out = protowire.AppendTag(out, fieldUnknownTypeMeta, protowire.BytesType)
	out = protowire.AppendBytes(out, typeMeta)
	out = protowire.AppendTag(out, fieldUnknownRaw, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(rawLen))
	out = protowire.AppendTag(out, fieldSliceMeta, protowire.BytesType)
	out = protowire.AppendBytes(out, meta)
	out = protowire.AppendTag(out, fieldSliceSpec, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(specLen))
	out = append(out, rest[:at]...)
	for _, enc := range written {
		out = protowire.AppendTag(out, fieldSpecDevices, protowire.BytesType)
		out = protowire.AppendBytes(out, enc)
	}
	out = append(out, rest[at:]...)
	out = protowire.AppendTag(out, fieldUnknownContentEncoding, protowire.BytesType)
	out = protowire.AppendBytes(out, nil)
	out = protowire.AppendTag(out, fieldUnknownContentType, protowire.BytesType)
	out = protowire.AppendBytes(out, nil)
	return out, written, nil
}

// errNotProtobuf: an answer not in client-go's protobuf encoding.
var errNotProtobuf = errors.New("not a protobuf-encoded object")

// readSlice decodes the API server's answer to a write of sent (its devices written
// as sentDevs, sliceBody's): the slice as stored, and for each of its devices whether
// it was stored as the bytes sent. Such a device is sent's (the same maps: read-only);
// the others are decoded. An answer of another encoding is errNotProtobuf.
func readSlice(answer []byte, sent *resourceapi.ResourceSlice, sentDevs [][]byte) (*resourceapi.ResourceSlice, []bool, error) {
	if !bytes.HasPrefix(answer, k8sProtobufPrefix) {
		return nil, nil, errNotProtobuf
	}
	var kind runtime.TypeMeta
	var raw []byte
	err := eachField(answer[len(k8sProtobufPrefix):], "the answer", func(num protowire.Number, contents, _ []byte) error {
		switch {
		case contents == nil:
		case num == fieldUnknownTypeMeta:
			kind = runtime.TypeMeta{}
			return kind.Unmarshal(contents)
		case num == fieldUnknownRaw:
			raw = contents
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	if want := resourceapi.SchemeGroupVersion.WithKind("ResourceSlice"); kind.APIVersion != want.GroupVersion().String() || kind.Kind != want.Kind {
		return nil, nil, fmt.Errorf("the answer is a %s %s, not a %s", kind.APIVersion, kind.Kind, want.Kind)
	}
	got := &resourceapi.ResourceSlice{}
	var devs [][]byte
	err = eachField(raw, "the answer's slice", func(num protowire.Number, value, _ []byte) error {
		switch {
		case value == nil:
		case num == fieldSliceMeta:
			if err := got.ObjectMeta.Unmarshal(value); err != nil {
				return fmt.Errorf("the answer's metadata: %w", err)
			}
		case num == fieldSliceSpec:
			// A field twice is merged, as the generated code does: the devices of
			// both, in order.
			more, rest, err := splitDevices(value)
			if err != nil {
				return err
			}
			devs = append(devs, more...)
			if err := got.Spec.Unmarshal(rest); err != nil {
				return fmt.Errorf("the answer's spec: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	same := make([]bool, len(devs))
	if len(devs) > 0 {
		got.Spec.Devices = make([]resourceapi.Device, len(devs))
	}
	for i, enc := range devs {
		if i < len(sentDevs) && i < len(sent.Spec.Devices) && bytes.Equal(enc, sentDevs[i]) {
			got.Spec.Devices[i] = sent.Spec.Devices[i]
			same[i] = true
			continue
		}
		if err := got.Spec.Devices[i].Unmarshal(enc); err != nil {
			return nil, nil, fmt.Errorf("the answer's device %d: %w", i, err)
		}
	}
	return got, same, nil
}

// eachField calls f with each field of message b, in order: its number, its contents
// where it is of the bytes type (nil otherwise), and the whole field, tag included. It
// stops at f's first error, or where b does not parse (what names b in that error).
func eachField(b []byte, what string, f func(num protowire.Number, contents, whole []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("%s: %w", what, protowire.ParseError(n))
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return fmt.Errorf("%s, field %d: %w", what, num, protowire.ParseError(m))
		}
		var contents []byte
		if typ == protowire.BytesType {
			contents, _ = protowire.ConsumeBytes(b[n : n+m])
			if contents == nil {
				contents = []byte{}
			}
		}
		if err := f(num, contents, b[:n+m]); err != nil {
			return err
		}
		b = b[n+m:]
	}
	return nil
}

// splitDevices splits an encoded ResourceSliceSpec into its devices' encodings and
// the encoding of its other fields.
func splitDevices(spec []byte) (devs [][]byte, rest []byte, err error) {
	err = eachField(spec, "the spec", func(num protowire.Number, contents, whole []byte) error {
		if num == fieldSpecDevices && contents != nil {
			devs = append(devs, contents)
		} else {
			rest = append(rest, whole...)
		}
		return nil
	})
	return devs, rest, err
}
