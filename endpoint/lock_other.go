//go:build !unix

package endpoint

// lockDir does nothing where flock is missing: the stale-socket check is then racy
// between hosts starting at the same moment.
func lockDir(string) (unlock func(), err error) { return func() {}, nil }
