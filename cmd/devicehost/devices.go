package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// runDevices is `devicehost devices`.
func runDevices(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "devices", "[-json] [-address ADDR]\n\nLists every device with its group, health and holder.")
	asJSON := fs.Bool("json", false, "print the Fingerprint snapshot as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	fp, err := c.Devices(ctx)
	if err != nil {
		return callError("fingerprint", err)
	}
	if *asJSON {
		return printJSON(env.stdout, fp)
	}
	t := newTable(env.stdout, "GROUP", "DEVICE", "HEALTH", "REASON", "HOLDER")
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			holder := cell("")
			if h := d.GetHolder(); h != nil {
				holder = fmt.Sprintf("%s (%s)", cell(h.GetOwnerId()), cell(h.GetReservationId()))
			}
			t.rowEscaped(cell(groupName(g.GetVendor(), g.GetType(), g.GetName())), cell(d.GetId()),
				cell(healthName(d.GetHealth())), cell(d.GetHealthReason()), holder)
		}
	}
	return t.flush()
}

// inferGroup finds the one group that holds every device in ids, among the groups
// matching the vendor, type and name given (empty matches any).
func inferGroup(fp *pb.FingerprintResponse, ids []string, vendor, typ, name string) (*pb.DeviceGroup, error) {
	var candidates []*pb.DeviceGroup
	for _, g := range fp.GetGroups() {
		if (vendor == "" || g.GetVendor() == vendor) && (typ == "" || g.GetType() == typ) && (name == "" || g.GetName() == name) {
			candidates = append(candidates, g)
		}
	}
	has := func(g *pb.DeviceGroup, id string) bool {
		return slices.ContainsFunc(g.GetDevices(), func(d *pb.Device) bool { return d.GetId() == id })
	}
	var holding []*pb.DeviceGroup
	for _, g := range candidates {
		if !slices.ContainsFunc(ids, func(id string) bool { return !has(g, id) }) {
			holding = append(holding, g)
		}
	}
	switch len(holding) {
	case 1:
		return holding[0], nil
	case 0:
		// Say which device is the problem.
		for _, id := range ids {
			var in []string
			for _, g := range candidates {
				if has(g, id) {
					in = append(in, groupName(g.GetVendor(), g.GetType(), g.GetName()))
				}
			}
			if len(in) == 0 {
				return nil, fmt.Errorf("device %s: the agent reports no such device%s", id, filterNote(vendor, typ, name))
			}
		}
		return nil, fmt.Errorf("devices %s are not all in one group; a reservation takes devices of one group", strings.Join(ids, ", "))
	default:
		var names []string
		for _, g := range holding {
			names = append(names, groupName(g.GetVendor(), g.GetType(), g.GetName()))
		}
		return nil, fmt.Errorf("devices %s are in more than one group (%s); choose with -vendor, -type and -name",
			strings.Join(ids, ", "), strings.Join(names, ", "))
	}
}

func filterNote(vendor, typ, name string) string {
	if vendor == "" && typ == "" && name == "" {
		return ""
	}
	return fmt.Sprintf(" in a group matching vendor=%q type=%q name=%q", vendor, typ, name)
}
