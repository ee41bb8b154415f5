package pluginloader_test

import (
	"context"
	"errors"
	"testing"

	"github.com/devicehost/devicehost/pluginloader"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
	"github.com/devicehost/devicehost/tools/fixtureplugin"
)

// CheckConfig asks the running process about a config and changes nothing: a config
// it accepts is nil, one it rejects a *ConfigError with its message, and the process
// serves on with the config it was launched with.
func TestCheckConfig(t *testing.T) {
	running := fixtureplugin.Config{Groups: []fixtureplugin.Group{{Vendor: "fixture", Type: "widget", Name: "running", IDs: []string{"r0"}}}}
	p := launchFixture(t, running, pluginloader.Options{})

	other := fixtureplugin.Config{Groups: []fixtureplugin.Group{{Vendor: "fixture", Type: "widget", Name: "other", IDs: []string{"o0"}}}}
	if err := p.CheckConfig(testContext(t), other.JSON()); err != nil {
		t.Errorf("CheckConfig of a good config: %v, want nil", err)
	}
	err := p.CheckConfig(testContext(t), fixtureplugin.Config{RejectConfig: "widgets must be blue"}.JSON())
	var ce *pluginloader.ConfigError
	if !errors.As(err, &ce) || ce.Plugin != fixtureplugin.Name || ce.Message != "widgets must be blue" || !errors.Is(err, pluginloader.ErrConfigRejected) {
		t.Errorf("CheckConfig of a rejected config: got %v, want a *ConfigError of %q with the plugin's message", err, fixtureplugin.Name)
	}
	if want := `plugin "fixture": widgets must be blue: plugin rejected its config`; err == nil || err.Error() != want {
		t.Errorf("rejection text: got %v, want %q", err, want)
	}

	// The process still runs the config it was launched with.
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	stream, err := p.Client().Fingerprint(ctx, &pb.FingerprintRequest{})
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	msg, err := stream.Recv()
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	if gs := msg.GetGroups(); len(gs) != 1 || gs[0].GetName() != "running" {
		t.Errorf("inventory after the checks: %v, want the running config's group only", gs)
	}
}

// A plugin without CheckConfig answers UNIMPLEMENTED: ErrConfigCheckUnsupported, not a
// rejection; a plugin that has exited says so.
func TestCheckConfigUnsupportedAndExited(t *testing.T) {
	p := launchFixture(t, fixtureplugin.Config{}, pluginloader.Options{Env: []string{"FIXTURE_NO_CHECK_CONFIG=1"}})
	err := p.CheckConfig(testContext(t), fixtureplugin.Config{RejectConfig: "no"}.JSON())
	if !errors.Is(err, pluginloader.ErrConfigCheckUnsupported) || errors.Is(err, pluginloader.ErrConfigRejected) {
		t.Errorf("CheckConfig on a plugin without it: got %v, want ErrConfigCheckUnsupported", err)
	}

	p.Kill(context.Background())
	err = p.CheckConfig(testContext(t), fixtureplugin.Config{}.JSON())
	if err == nil || errors.Is(err, pluginloader.ErrConfigRejected) || errors.Is(err, pluginloader.ErrConfigCheckUnsupported) {
		t.Errorf("CheckConfig on an exited plugin: got %v, want an error that is neither a rejection nor unsupported", err)
	}
}
