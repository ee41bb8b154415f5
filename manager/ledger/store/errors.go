package store

import (
	"errors"
	"fmt"
)

// Errors of the state file, matched with errors.Is; Open returns each inside a
// *StateFileError.
var (
	// ErrCorrupt: the state file is not a bbolt file, fails its consistency check, or
	// holds a record that cannot be read.
	ErrCorrupt = errors.New("state file corrupt")
	// ErrSchemaVersion: the state file was written with a schema this build does not
	// know.
	ErrSchemaVersion = errors.New("unsupported state schema version")
	// ErrLocked: another process (another devicehost) has the state file open.
	ErrLocked = errors.New("state dir in use by another devicehost")
)

// StateFileError is why a state file was refused: what is wrong with it and what an
// operator can do about it. It matches its Kind (ErrCorrupt, ErrSchemaVersion or
// ErrLocked) and its underlying cause under errors.Is.
type StateFileError struct {
	Path     string
	Kind     error  // ErrCorrupt, ErrSchemaVersion or ErrLocked
	Problem  string // what is wrong, e.g. `reservation record "res-1f..": checksum mismatch`
	Recovery string // what to do about it
	Err      error  // the underlying error, if any
}

// Error renders "state file PATH: PROBLEM; RECOVERY".
func (e *StateFileError) Error() string {
	return fmt.Sprintf("state file %s: %s; %s", e.Path, e.Problem, e.Recovery)
}

// Unwrap returns the Kind and the underlying error.
func (e *StateFileError) Unwrap() []error {
	if e.Err == nil {
		return []error{e.Kind}
	}
	return []error{e.Kind, e.Err}
}

// CorruptError is the *StateFileError of a damaged file at path, left untouched.
func CorruptError(path, problem string, err error) *StateFileError {
	return &StateFileError{
		Path:    path,
		Kind:    ErrCorrupt,
		Problem: problem,
		Recovery: fmt.Sprintf("the file was left untouched: restore it from a backup, or move it aside "+
			"(mv %s %s.corrupt) to start with an empty ledger (held devices will be forgotten)", path, path),
		Err: err,
	}
}
