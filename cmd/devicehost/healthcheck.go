package main

import (
	"context"
	"fmt"

	"github.com/devicehost/devicehost/client"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/textline"
)

// Exit codes of `devicehost health-check`, as node-problem-detector's custom plugin
// monitor reads them.
const (
	npdOK      = 0 // every device healthy
	npdNonOK   = 1 // a device is not healthy: the condition turns on
	npdUnknown = 2 // the agent cannot be asked (or a usage mistake)
)

// exitStatus ends a command with its code, its message already printed.
type exitStatus int

func (e exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// maxHealthLine bounds the line health-check prints (NPD keeps max_output_length of it,
// 80 by default; the full list is in `devicehost devices`).
const maxHealthLine = 512

// maxHealthNamed bounds the devices the line names (", and N more" after them).
const maxHealthNamed = 16

// runHealthCheck is `devicehost health-check`: one line on stdout and NPD's exit code.
func runHealthCheck(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "health-check", "[-address ADDR] [-vendor V] [-type T]\n\n"+
		"A node-problem-detector custom plugin: prints one line and exits 0 when every device\n"+
		"the agent serves (of -vendor and -type, if given) is healthy, 1 when any is not (the\n"+
		"line names them and why), 2 when the agent cannot be asked. Cordoned devices count as\n"+
		"they are: cordoning is no health problem.")
	vendor := fs.String("vendor", "", "only devices of this vendor")
	typ := fs.String("type", "", "only devices of this type")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		fmt.Fprintln(env.stdout, textline.Line("devicehost agent unreachable: "+err.Error(), maxHealthLine))
		return exitStatus(npdUnknown)
	}
	defer done()
	fp, err := c.Devices(ctx)
	if err != nil {
		fmt.Fprintln(env.stdout, textline.Line("devicehost agent unreachable: "+callError("fingerprint", err).Error(), maxHealthLine))
		return exitStatus(npdUnknown)
	}
	h := client.HealthOf(fp, func(g *pb.DeviceGroup) bool {
		return (*vendor == "" || g.GetVendor() == *vendor) && (*typ == "" || g.GetType() == *typ)
	})
	fmt.Fprintln(env.stdout, h.Line(maxHealthNamed, maxHealthLine))
	if len(h.Unhealthy) == 0 {
		return nil
	}
	return exitStatus(npdNonOK)
}
