package main

import (
	"context"
	"fmt"
	"sort"
	"strings"

	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
)

// stringList is a repeatable flag; a comma-separated value adds each part.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// optionMap is a repeatable key=value flag: plugin options (ReserveRequest.plugin_options).
type optionMap map[string]string

func (m optionMap) String() string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

func (m optionMap) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q: want key=value", v)
	}
	if _, dup := m[k]; dup {
		return fmt.Errorf("%q: option %s given twice", v, k)
	}
	m[k] = val
	return nil
}

const reserveUsage = `-owner ID -device ID [-device ID...] [-vendor V -type T -name N] [-option KEY=VALUE...] [-json]

Reserves devices of one group for an owner (the allocation that will use them) and
prints how to expose them to a container. The group is found from the agent's
inventory when the devices are in exactly one; -vendor, -type and -name narrow it
(all three skip the look-up). -option passes an option to the plugin that owns the
devices (e.g. -option mps_isolation=per-holder for the nvidia-example plugin's MPS
shares); a plugin refuses one it does not take.`

// runReserve is `devicehost reserve`.
func runReserve(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "reserve", reserveUsage)
	owner := fs.String("owner", "", "owner `ID` (the allocation), required")
	var devices stringList
	fs.Var(&devices, "device", "device `ID` to reserve; repeat for more (or separate with commas)")
	vendor := fs.String("vendor", "", "group vendor")
	typ := fs.String("type", "", "group type")
	name := fs.String("name", "", "group name (model)")
	options := optionMap{}
	fs.Var(options, "option", "plugin option `KEY=VALUE` for the Reserve; repeat for more")
	asJSON := fs.Bool("json", false, "print the response as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *owner == "" {
		return usagef("-owner is required")
	}
	if len(devices) == 0 {
		return usagef("at least one -device is required")
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()

	req := &pb.ReserveRequest{OwnerId: *owner, Vendor: *vendor, Type: *typ, Name: *name, DeviceIds: devices}
	if len(options) > 0 {
		req.PluginOptions = options
	}
	if *vendor == "" || *typ == "" || *name == "" {
		fp, err := c.Devices(ctx)
		if err != nil {
			return callError("fingerprint", err)
		}
		g, err := inferGroup(fp, devices, *vendor, *typ, *name)
		if err != nil {
			return callError("reserve", err)
		}
		req.Vendor, req.Type, req.Name = g.GetVendor(), g.GetType(), g.GetName()
	}
	resp, err := c.Reserve(ctx, req)
	if err != nil {
		return callError("reserve", err)
	}
	if *asJSON {
		return printJSON(env.stdout, resp)
	}
	t := newTable(env.stdout, "RESERVATION", resp.GetReservationId())
	printContainer(t, resp.GetReservation())
	return t.flush()
}

// printContainer adds a container reservation's parts as rows.
func printContainer(t *table, r *pb.ContainerReservation) {
	keys := make([]string, 0, len(r.GetEnvs()))
	for k := range r.GetEnvs() {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		t.row("env", k+"="+r.GetEnvs()[k])
	}
	for _, name := range r.GetCdiDevices() {
		t.row("cdi", name)
	}
	for _, m := range r.GetMounts() {
		mode := "rw"
		if m.GetReadOnly() {
			mode = "ro"
		}
		t.row("mount", fmt.Sprintf("%s -> %s (%s)", m.GetHostPath(), m.GetContainerPath(), mode))
	}
	for _, d := range r.GetDevices() {
		t.row("device", fmt.Sprintf("%s -> %s (%s)", d.GetHostPath(), d.GetContainerPath(), d.GetPermissions()))
	}
}

const releaseUsage = `-reservation ID | -owner ID [-json]

Releases one reservation, or every live reservation of an owner. Releasing what is
already released is not an error.`

// runRelease is `devicehost release`.
func runRelease(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "release", releaseUsage)
	reservation := fs.String("reservation", "", "reservation `ID` to release")
	owner := fs.String("owner", "", "release every live reservation of this owner `ID`")
	asJSON := fs.Bool("json", false, "print the response as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	req := &pb.ReleaseRequest{}
	switch {
	case (*reservation == "") == (*owner == ""):
		return usagef("give exactly one of -reservation and -owner")
	case *reservation != "":
		req.Target = &pb.ReleaseRequest_ReservationId{ReservationId: *reservation}
	default:
		req.Target = &pb.ReleaseRequest_OwnerId{OwnerId: *owner}
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	resp, err := c.Release(ctx, req)
	if err != nil {
		return callError("release", err)
	}
	if *asJSON {
		return printJSON(env.stdout, resp)
	}
	if len(resp.GetReleasedReservationIds()) == 0 && len(resp.GetAlreadyReleasedReservationIds()) == 0 {
		fmt.Fprintln(env.stdout, "nothing released: the owner has no reservations")
		return nil
	}
	for _, id := range resp.GetReleasedReservationIds() {
		fmt.Fprintf(env.stdout, "released %s\n", id)
	}
	for _, id := range resp.GetAlreadyReleasedReservationIds() {
		fmt.Fprintf(env.stdout, "already released %s (nothing done)\n", id)
	}
	return nil
}

// reservationStates are the -state values of `devicehost reservations`.
var reservationStates = map[string]pb.ReservationState{
	"any":      pb.ReservationState_RESERVATION_STATE_UNSPECIFIED,
	"active":   pb.ReservationState_RESERVATION_STATE_ACTIVE,
	"released": pb.ReservationState_RESERVATION_STATE_RELEASED,
}

// runReservations is `devicehost reservations`.
func runReservations(ctx context.Context, env *cmdEnv, args []string) error {
	fs, cf := newClientFlagSet(env, "reservations", "[-owner ID] [-device ID] [-state active|released|any] [-json]\n\nLists the reservation ledger.")
	owner := fs.String("owner", "", "only this owner's reservations")
	dev := fs.String("device", "", "only reservations of this device")
	state := fs.String("state", "any", "only reservations in this `state`: active, released or any")
	asJSON := fs.Bool("json", false, "print the response as JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	st, ok := reservationStates[*state]
	if !ok {
		return usagef("-state %q: want active, released or any", *state)
	}
	ctx, c, done, err := cf.dial(ctx)
	if err != nil {
		return err
	}
	defer done()
	rs, err := c.Reservations(ctx, &pb.ListReservationsRequest{OwnerId: *owner, DeviceId: *dev, State: st})
	if err != nil {
		return callError("list reservations", err)
	}
	if *asJSON {
		return printJSON(env.stdout, &pb.ListReservationsResponse{Reservations: rs})
	}
	withOptions := false
	for _, r := range rs {
		withOptions = withOptions || len(r.GetPluginOptions()) > 0
	}
	cols := []string{"RESERVATION", "OWNER", "GROUP", "DEVICES", "STATE", "CREATED", "RELEASED"}
	if withOptions {
		cols = append(cols, "OPTIONS")
	}
	t := newTable(env.stdout, cols...)
	for _, r := range rs {
		stateText := reservationStateName(r.GetState())
		if r.GetCleanupPending() {
			stateText += " (cleanup pending)"
		}
		owner := r.GetOwnerId()
		if pods := r.GetOwnerLabels()["pod"]; pods != "" { // the pods a DRA claim is reserved for
			owner += " (pods " + pods + ")"
		}
		row := []string{r.GetReservationId(), owner, groupName(r.GetVendor(), r.GetType(), r.GetName()),
			strings.Join(r.GetDeviceIds(), ","), stateText, formatTime(r.GetCreatedAt()), formatTime(r.GetReleasedAt())}
		if withOptions {
			row = append(row, optionMap(r.GetPluginOptions()).String())
		}
		t.row(row...)
	}
	return t.flush()
}
