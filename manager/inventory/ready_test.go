package inventory

import (
	"errors"
	"testing"
	"time"
)

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Started closes once every plugin has been launched (Running), failed a run or failed
// for good, before Ready (which waits for the fingerprints); not while one is still
// starting.
func TestStartedBeforeReady(t *testing.T) {
	r := New(Config{})
	for _, name := range []string{"a", "b", "c"} {
		r.AddPlugin(name, "/bin/"+name)
	}
	r.Running("a", "1")
	r.Restarting("b", errors.New("exit status 1"), time.Second)
	if closed(r.Started()) {
		t.Fatal("Started closed while plugin c is still starting")
	}
	r.Failed("c", errors.New("plugin rejected its config"))
	if !closed(r.Started()) {
		t.Fatal("Started open with a running, b restarting and c failed")
	}
	if closed(r.Ready()) {
		t.Fatal("Ready closed before plugin a fingerprinted")
	}
}

// Ready forced closes Started too; a registry with no plugin is started at its first
// check.
func TestStartedForcedAndEmpty(t *testing.T) {
	r := New(Config{})
	r.AddPlugin("hung", "/bin/hung")
	r.ForceReady()
	if !closed(r.Started()) {
		t.Error("Started open after ForceReady")
	}
	empty := New(Config{})
	empty.CheckReady()
	if !closed(empty.Started()) {
		t.Error("Started open on a registry with no plugins")
	}
}
