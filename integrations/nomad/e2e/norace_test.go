//go:build !race

package e2e

// raceEnabled: the tests run without -race.
const raceEnabled = false
