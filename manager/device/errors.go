package device

import (
	"errors"
	"fmt"
)

// Sentinel errors. A Manager wraps them with the details (device IDs, holder, plugin,
// rule), so callers test with errors.Is and show err.Error() to people.
var (
	// ErrInvalidRequest: the request itself is malformed. Wrapped in a *FieldError
	// where one field is to blame.
	ErrInvalidRequest = errors.New("invalid request")
	// ErrUnknownDevice: a device ID (or group) that no plugin reports.
	ErrUnknownDevice = errors.New("unknown device")
	// ErrUnhealthyDevice: the device exists but is not healthy.
	ErrUnhealthyDevice = errors.New("device unhealthy")
	// ErrDeviceHeld: the device is held by a live reservation of another owner, or the
	// request overlaps one only in part.
	ErrDeviceHeld = errors.New("device held")
	// ErrPluginUnavailable: the owning plugin is not running or did not answer in time.
	ErrPluginUnavailable = errors.New("plugin unavailable")
	// ErrPluginResponse: the plugin answered, but its answer broke a validation rule.
	ErrPluginResponse = errors.New("invalid plugin response")
	// ErrNotFound: a reservation that the ledger does not have.
	ErrNotFound = errors.New("not found")
	// ErrShuttingDown: the manager is shutting down and takes no new work.
	ErrShuttingDown = errors.New("shutting down")
)

// FieldError says which request field is wrong and why. It matches ErrInvalidRequest
// under errors.Is.
type FieldError struct {
	Field string // e.g. "owner_id", "device_ids[2]"
	Rule  string // e.g. "must not be empty"
}

// Error renders "invalid request: owner_id: must not be empty".
func (e *FieldError) Error() string {
	return fmt.Sprintf("%v: %s: %s", ErrInvalidRequest, e.Field, e.Rule)
}

// Is makes errors.Is(err, ErrInvalidRequest) true for any *FieldError.
func (e *FieldError) Is(target error) bool { return target == ErrInvalidRequest }
