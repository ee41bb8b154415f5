package inventory

import (
	"fmt"
	"math"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/validate"
)

// Byte budgets of the host API's streamed messages.
//
// One Fingerprint message carries every plugin's inventory with the devices' state, and
// one Stats message every plugin's stats; a client refuses a message over its receive
// limit (gRPC's default, 4 MiB, is grpcurl's and the CLI's), and then sees no device at
// all. validate caps one plugin's messages (validate.MaxFingerprintBytes,
// validate.MaxStatsBytes); the registry and Stats cap the sum. It charges each plugin, for its
// last good fingerprint, the most that inventory can take in the host's message: the
// plugin's own encoded bytes plus what the host adds to each group (the plugin's name)
// and to each device (health since-when, a holder with the longest owner and
// reservation IDs, a reason of the host's own, a locality), whatever the devices' state
// later becomes. A fingerprint whose charge would take the sum over MaxSnapshotBytes is
// refused and the plugin keeps its last good inventory; stats likewise against
// MaxStatsSnapshotBytes. Both limits leave half a MiB below 4 MiB for what the
// estimate does not see (field order, future fields).
const (
	// MaxSnapshotBytes bounds the encoded size of one host API Fingerprint message.
	MaxSnapshotBytes = 3584 << 10
	// MaxStatsSnapshotBytes bounds the encoded size of one host API Stats message.
	MaxStatsSnapshotBytes = 3584 << 10
)

// maxHostIDLen is the longest owner or reservation ID the host puts in a holder
// (validate.MaxNameLen for owners; ledger IDs are shorter).
const maxHostIDLen = validate.MaxNameLen

var (
	// timestampBytes is the most an encoded google.protobuf.Timestamp field takes, as
	// any field number up to 15: tag, length, seconds up to year 9999, nanos.
	timestampBytes = fieldBytes(
		protowire.SizeTag(1) + protowire.SizeVarint(253402300799) +
			protowire.SizeTag(2) + protowire.SizeVarint(999999999))
	// hostDeviceBytes is the most the host adds to one device of a plugin's fingerprint:
	// health_since; health UNKNOWN where the plugin left it unset; a holder; a reason of
	// its own (a capped error, or "reported unhealthy by plugin NAME"); a locality where
	// the plugin sent none (NUMA -1 is a 10-byte varint); and a longer length prefix.
	hostDeviceBytes = timestampBytes +
		protowire.SizeTag(2) + 1 +
		fieldBytes(2*fieldBytes(maxHostIDLen)) +
		fieldBytes(max(MaxErrorLen, len(unhealthyByPlugin)+validate.MaxNameLen)) +
		fieldBytes(protowire.SizeTag(2)+protowire.SizeVarint(math.MaxUint64)) +
		2
	// hostStatsDeviceBytes is the most the host adds to one device's stats: a
	// timestamp where the plugin sent none, and a longer length prefix.
	hostStatsDeviceBytes = timestampBytes + 2
)

// unhealthyByPlugin starts the reason the host gives an unhealthy device whose plugin
// gave none.
const unhealthyByPlugin = "reported unhealthy by plugin "

// fieldBytes is the size of an embedded message or string field of n bytes, numbered
// up to 15.
func fieldBytes(n int) int { return protowire.SizeTag(1) + protowire.SizeVarint(uint64(n)) + n }

// fingerprintCost is what plugin's fingerprint resp is charged against
// MaxSnapshotBytes (see the budget's doc above).
func fingerprintCost(plugin string, resp *pb.FingerprintResponse) int {
	n := proto.Size(resp)
	for _, g := range resp.GetGroups() {
		// The plugin's name, and a group's length prefix that may grow up to 3 bytes.
		n += fieldBytes(len(plugin)) + 3
		n += len(g.GetDevices()) * hostDeviceBytes
	}
	return n
}

// statsGroupCost is what the host adds to a plugin's stats for its inventory: each
// group's header (vendor, type, name, plugin) and length prefix.
func statsGroupCost(plugin string, resp *pb.FingerprintResponse) int {
	n := 0
	for _, g := range resp.GetGroups() {
		header := fieldBytes(len(g.GetVendor())) + fieldBytes(len(g.GetType())) +
			fieldBytes(len(g.GetName())) + fieldBytes(len(plugin))
		n += header + protowire.SizeTag(1) + protowire.SizeVarint(math.MaxUint32)
	}
	return n
}

// statsCost is what a plugin's stats message is charged against
// MaxStatsSnapshotBytes; groupCost is its statsGroupCost.
func statsCost(resp *pb.StatsResponse, groupCost int) int {
	return proto.Size(resp) + len(resp.GetDevices())*hostStatsDeviceBytes + groupCost
}

// budgetError is a plugin message refused because the host's message would grow over
// its limit.
type budgetError struct {
	plugin string
	what   string // "fingerprint" or "stats"
	cost   int    // what this message is charged
	others int    // what the other plugins are charged
	limit  int
}

func (e *budgetError) Error() string {
	return fmt.Sprintf("%s of plugin %q refused: it would take %d bytes of the host's %s message beside %d bytes of the other plugins', over the limit of %d bytes; the last good one stays",
		e.what, e.plugin, e.cost, e.what, e.others, e.limit)
}
