package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// runDevices is `devicehost devices`.
func runDevices(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "devices", "[-json] [-address ADDR]\n\nLists every device with its group, health, holder and cordon.")
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
	// Partitioned devices (shared counters) get a column naming the counter sets each
	// uses (for a MIG partition, its GPU), and a free device that cannot be reserved
	// now names the reservations that block it where the holder would be.
	shared := anyDevice(fp, func(d *pb.Device) bool { return len(d.GetConsumes()) > 0 })
	header := []string{"GROUP", "DEVICE", "HEALTH", "REASON", "HOLDER", "CORDONED"}
	// Admin accesses (monitoring or debugging workloads that see a device without
	// holding it) get a column of their own, apart from the holder.
	admin := anyDevice(fp, func(d *pb.Device) bool { return len(d.GetAdminAccess()) > 0 })
	if admin {
		header = append(header, "ADMIN ACCESS")
	}
	if shared {
		header = append(header, "SHARES")
	}
	t := newTable(env.stdout, header...)
	for _, g := range fp.GetGroups() {
		for _, d := range g.GetDevices() {
			holder := cell("")
			if h := d.GetHolder(); h != nil {
				holder = fmt.Sprintf("%s (%s)", cell(h.GetOwnerId()), cell(h.GetReservationId()))
			} else if bs := d.GetBlockedBy(); len(bs) > 0 {
				holder = fmt.Sprintf("blocked by %s (%s)", cell(bs[0].GetOwnerId()), cell(bs[0].GetReservationId()))
				if len(bs) > 1 {
					holder += fmt.Sprintf(" and %d more", len(bs)-1)
				}
			}
			row := []string{cell(groupName(g.GetVendor(), g.GetType(), g.GetName())), cell(d.GetId()),
				cell(healthName(d.GetHealth())), cell(d.GetHealthReason()), holder, cordonCell(d.GetCordon())}
			if admin {
				var owners []string
				for _, a := range d.GetAdminAccess() {
					owners = append(owners, fmt.Sprintf("%s (%s)", cell(a.GetOwnerId()), cell(a.GetReservationId())))
				}
				if len(owners) == 0 {
					owners = []string{cell("")}
				}
				row = append(row, strings.Join(owners, ", "))
			}
			if shared {
				sets := make([]string, len(d.GetConsumes()))
				for i, c := range d.GetConsumes() {
					sets[i] = c.GetCounterSet()
				}
				row = append(row, cell(strings.Join(sets, ",")))
			}
			t.rowEscaped(row...)
		}
	}
	return t.flush()
}

// inferGroup finds the one group that holds every device in ids, among the groups
// matching the vendor, type and name given (empty matches any). Devices in no such
// group are a NOT_FOUND status worded as the agent words a Reserve of unknown devices,
// so that `reserve` says the same with and without -vendor, -type and -name.
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
		// Say which devices are the problem.
		var unknown []string
		for _, id := range ids {
			if !slices.ContainsFunc(candidates, func(g *pb.DeviceGroup) bool { return has(g, id) }) {
				unknown = append(unknown, id)
			}
		}
		if len(unknown) > 0 {
			return nil, status.Errorf(codes.NotFound, "%s not in %s: %v", devicesAre(unknown), groupsNote(vendor, typ, name), device.ErrUnknownDevice)
		}
		return nil, fmt.Errorf("devices %s are not all in one group; a reservation takes devices of one group", strings.Join(ids, ", "))
	default:
		var names []string
		for _, g := range holding {
			names = append(names, groupName(g.GetVendor(), g.GetType(), g.GetName()))
		}
		return nil, fmt.Errorf("%s in more than one group (%s); choose with -vendor, -type and -name",
			devicesAre(ids), strings.Join(names, ", "))
	}
}

// devicesAre is "device ID is" or "devices ID1, ID2 are".
func devicesAre(ids []string) string {
	if len(ids) == 1 {
		return "device " + ids[0] + " is"
	}
	return "devices " + strings.Join(ids, ", ") + " are"
}

// groupsNote names the groups a device was looked for in.
func groupsNote(vendor, typ, name string) string {
	if vendor == "" && typ == "" && name == "" {
		return "any group of the agent's"
	}
	return fmt.Sprintf("any group matching vendor=%q type=%q name=%q", vendor, typ, name)
}

// cordonCell is the CORDONED column: the reason of a cordon, "drain: " before it for a
// drain; empty for a device in service.
func cordonCell(c *pb.Cordon) string {
	switch {
	case c == nil:
		return cell("")
	case c.GetDrain():
		return "drain: " + cell(c.GetReason())
	default:
		return cell(c.GetReason())
	}
}

// anyDevice reports whether some device of fp satisfies f.
func anyDevice(fp *pb.FingerprintResponse, f func(*pb.Device) bool) bool {
	return slices.ContainsFunc(fp.GetGroups(), func(g *pb.DeviceGroup) bool { return slices.ContainsFunc(g.GetDevices(), f) })
}
