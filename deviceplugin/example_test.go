package deviceplugin_test

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/devicehost/devicehost/deviceplugin"
	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// widgets is a complete device plugin: one widget, its temperature every interval.
type widgets struct{}

func (widgets) Info() deviceplugin.Info                 { return deviceplugin.Info{Name: "widgets", Version: "0.1.0"} }
func (widgets) SetConfig(context.Context, []byte) error { return nil }

func (widgets) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	w0 := &pb.Device{Id: "w0", Health: pb.Health_HEALTH_HEALTHY, Locality: &pb.Locality{NumaNode: -1}}
	group := &pb.DeviceGroup{Vendor: "acme", Type: "widget", Name: "Widget 1", Devices: []*pb.Device{w0}}
	if err := send(&pb.FingerprintResponse{Groups: []*pb.DeviceGroup{group}}); err != nil {
		return err
	}
	<-ctx.Done() // nothing ever changes
	return nil
}

func (widgets) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-tick.C:
			temp := map[string]*pb.Value{"temperature": {Kind: &pb.Value_FloatValue{FloatValue: 41.5}, Unit: "C"}}
			w0 := &pb.DeviceStats{DeviceId: "w0", Values: temp, Timestamp: timestamppb.New(now)}
			if err := send(&pb.StatsResponse{Devices: []*pb.DeviceStats{w0}}); err != nil {
				return err
			}
		}
	}
}

func (widgets) Reserve(_ context.Context, ids []string) (*pb.ContainerReservation, error) {
	if len(ids) != 1 || ids[0] != "w0" {
		return nil, fmt.Errorf("unknown device IDs %q: only w0 exists", ids)
	}
	return &pb.ContainerReservation{Envs: map[string]string{"WIDGETS": "w0"}}, nil
}

// A plugin implements deviceplugin.Plugin and its main calls Serve; the host launches
// the binary, and Serve returns when the host stops the plugin.
func Example() {
	deviceplugin.Serve(widgets{})
}
