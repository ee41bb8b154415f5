//go:build !race

package agenttest

// Race is whether this program was built with -race; Binary builds devicehost the same
// way.
const Race = false
