package metrics

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/devicehost/devicehost/device"
)

// A process's reservation is read from the environment it started with: a child
// started with the variable among others is found by its PID, one without it has none,
// and a gone process is not visible.
func TestProcReservation(t *testing.T) {
	start := func(env ...string) *exec.Cmd {
		cmd := exec.Command("sleep", "60")
		cmd.Env = append(env, "PATH="+os.Getenv("PATH"))
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	with := start("A=1", device.ReservationEnv+"=res-0123456789abcdef", "B="+strings.Repeat("x", 4096))
	without := start("A=1")
	if got, visible := procReservation(uint32(with.Process.Pid)); got != "res-0123456789abcdef" || !visible {
		t.Errorf("the reservation of a process started with %s: %q (visible %v)", device.ReservationEnv, got, visible)
	}
	if got, visible := procReservation(uint32(without.Process.Pid)); got != "" || !visible {
		t.Errorf("the reservation of a process started without it: %q (visible %v), want none, visible", got, visible)
	}
	without.Process.Kill()
	without.Wait()
	if got, visible := procReservation(uint32(without.Process.Pid)); got != "" || visible {
		t.Errorf("the reservation of a gone process: %q (visible %v), want none, not visible", got, visible)
	}
}

// reservationIn takes the variable's value only: not a longer name that starts like it,
// not a value too long for a reservation ID, and the last entry without a NUL after it.
func TestReservationIn(t *testing.T) {
	for env, want := range map[string]string{
		device.ReservationEnv + "X=res-1\x00":                                     "",
		"A=1\x00" + device.ReservationEnv + "=res-2":                              "res-2",
		device.ReservationEnv + "=" + strings.Repeat("r", 65) + "\x00":            "",
		"\x00\x00" + device.ReservationEnv + "=res-3\x00" + device.ReservationEnv: "res-3",
	} {
		if got := reservationIn([]byte(env)); got != want {
			t.Errorf("reservationIn(%q) = %q, want %q", env, got, want)
		}
	}
}
