package main

import (
	"context"
	"strconv"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

// runPlugins is `devicehost plugins`.
func runPlugins(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "plugins", "[-json] [-address ADDR]\n\nLists the plugins with their status, restarts and last error.")
	asJSON := fs.Bool("json", false, "print the response as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	plugins, err := c.Plugins(ctx)
	if err != nil {
		return callError("list plugins", err)
	}
	if *asJSON {
		return printJSON(env.stdout, &pb.ListPluginsResponse{Plugins: plugins})
	}
	t := newTable(env.stdout, "PLUGIN", "VERSION", "STATUS", "DEVICES", "RESTARTS", "NEXT RETRY", "LAST ERROR")
	for _, p := range plugins {
		lastErr := p.GetLastError()
		if lastErr != "" && p.GetLastErrorAt() != nil {
			lastErr = formatTime(p.GetLastErrorAt()) + ": " + lastErr
		}
		t.row(p.GetName(), p.GetVersion(), pluginStatusName(p.GetStatus()),
			strconv.FormatUint(uint64(p.GetDeviceCount()), 10), strconv.FormatUint(uint64(p.GetRestarts()), 10),
			formatTime(p.GetNextRetry()), textline.Words(lastErr, 0))
	}
	return t.flush()
}
