package metrics

import (
	"bytes"
	"io"
	"os"
	"strconv"

	"github.com/devicehost/devicehost/device"
)

// maxEnvironBytes bounds what is read of one process's environment: a process may have
// megabytes of it, and the reservation's variable is one of the first a container
// runtime sets.
const maxEnvironBytes = 256 << 10

// procReservation returns the reservation a process belongs to: the value of
// device.ReservationEnv in the environment it started with (/proc/<pid>/environ), which
// the host gave its container; "" when it has none. visible is false when the
// process's environment cannot be read (gone, in a PID namespace the agent does not
// see, no permission).
func procReservation(pid uint32) (reservation string, visible bool) {
	f, err := os.Open("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/environ")
	if err != nil {
		return "", false
	}
	defer f.Close()
	env, err := io.ReadAll(io.LimitReader(f, maxEnvironBytes))
	if err != nil {
		return "", false
	}
	return reservationIn(env), true
}

// reservationIn finds device.ReservationEnv's value in a NUL-separated environment. A
// value longer than a reservation ID could be is ignored.
func reservationIn(env []byte) string {
	prefix := []byte(device.ReservationEnv + "=")
	for len(env) > 0 {
		var kv []byte
		if i := bytes.IndexByte(env, 0); i >= 0 {
			kv, env = env[:i], env[i+1:]
		} else {
			kv, env = env, nil
		}
		if v, ok := bytes.CutPrefix(kv, prefix); ok && len(v) <= 64 {
			return string(v)
		}
	}
	return ""
}
