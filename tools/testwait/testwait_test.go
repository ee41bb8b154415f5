package testwait

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"
)

func TestPollReturnsOnceCondHolds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start, calls := time.Now(), 0
		if _, err := poll(time.Minute, 50*time.Millisecond, func() (bool, string) { calls++; return calls == 4, "" }); err != nil {
			t.Fatal("poll gave up on a condition that held at its 4th call")
		}
		// 1 + 2 + 4 ms of backoff, on synctest's clock.
		if waited := time.Since(start); waited != 7*time.Millisecond {
			t.Errorf("poll waited %v for the 4th call, want 7ms", waited)
		}
	})
}

func TestPollGivesUpAfterLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start, calls := time.Now(), 0
		_, err := poll(time.Second, 50*time.Millisecond, func() (bool, string) { calls++; return false, fmt.Sprintf("call %d", calls) })
		if err == nil {
			t.Fatal("poll reported a condition that never held")
		}
		if want := fmt.Sprintf("not within 1s; last: call %d", calls); err.Error() != want {
			t.Errorf("poll's error %q, want %q (the last status)", err, want)
		}
		waited := time.Since(start)
		if waited <= time.Second || waited > time.Second+50*time.Millisecond {
			t.Errorf("poll gave up after %v, want just over its 1s limit", waited)
		}
		if calls < 20 {
			t.Errorf("%d calls in 1s, want one at least every 50ms", calls)
		}
	})
}

func TestTimeoutFromEnvironment(t *testing.T) {
	if got := timeout(""); got != defaultTimeout {
		t.Errorf("timeout(unset) = %v, want %v", got, defaultTimeout)
	}
	if got := timeout("2m"); got != 2*time.Minute {
		t.Errorf("timeout(2m) = %v, want 2m", got)
	}
	for _, bad := range []string{"60", "-1s", "0s", "soon"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("timeout(%q) did not panic", bad)
				}
			}()
			timeout(bad)
		}()
	}
}
