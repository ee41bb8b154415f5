// Package validate holds pure functions that check what crosses a trust boundary: plugin
// output (fingerprints, stats, reservations, in the plugin protocol's own types, before
// anything is converted or stored) and host API requests (in the manager contract's
// domain types).
//
// Every function returns nil or the errors.Join of every violation, each naming the item
// and the rule it broke.
//
// THIS FILE IS THE AGREED API; bodies marked TODO(validate) are being written.
package validate

import (
	"github.com/devicehost/devicehost/manager/device"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Fingerprint checks a plugin's fingerprint.
func Fingerprint(resp *pb.FingerprintResponse) error { return nil } // TODO(validate)

// Stats checks a plugin's stats message; known reports whether a device ID is one the
// plugin fingerprinted.
func Stats(resp *pb.StatsResponse, known func(deviceID string) bool) error { return nil } // TODO(validate)

// Reservation checks a plugin's answer to Reserve(requested).
func Reservation(res *pb.ContainerReservation, requested []string) error { return nil } // TODO(validate)

// ReserveRequest checks a host API Reserve request; violations are *device.FieldError.
func ReserveRequest(req device.ReserveRequest) error { return nil } // TODO(validate)

// ReleaseRequest checks a host API Release request; violations are *device.FieldError.
func ReleaseRequest(req device.ReleaseRequest) error { return nil } // TODO(validate)
