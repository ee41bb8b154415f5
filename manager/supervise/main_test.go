package supervise

import (
	"testing"

	"go.uber.org/goleak"
)

// The supervisor's behaviour is tested through the manager (manager's tests run real
// and in-process plugins under it); these are the unit tests of its parts.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
