package adapter

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/hashicorp/nomad/plugins/device"
	nproto "github.com/hashicorp/nomad/plugins/device/proto"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// Fingerprint forwards the Nomad plugin's fingerprints, translated, until ctx ends or
// the Nomad plugin's stream fails or ends (returned as an error: the host then
// restarts the adapter). Nomad plugins send their full inventory on every change, as
// devicehost wants it. If the Nomad plugin has sent nothing EmptyInventoryAfter after
// the stream opened (a Nomad plugin that found no devices stays silent), an empty
// inventory is sent.
func (a *Adapter) Fingerprint(ctx context.Context, send func(*pb.FingerprintResponse) error) error {
	in, err := a.current()
	if err != nil {
		return err
	}
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	ch, err := in.dev.Fingerprint(ctx)
	if err != nil {
		cancel()
		if parent.Err() != nil {
			return nil // ended by the caller while the stream was being opened
		}
		return pluginError(in, "fingerprint", err)
	}
	defer stopStream(cancel, ch)
	var quiet <-chan time.Time
	if in.emptyAfter > 0 {
		t := time.NewTimer(in.emptyAfter)
		defer t.Stop()
		quiet = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-quiet:
			in.known.set(nil)
			if err := send(&pb.FingerprintResponse{}); err != nil {
				return err
			}
		case resp, ok := <-ch:
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				return errors.New("fingerprint: the Nomad plugin ended its stream")
			}
			if resp == nil {
				continue
			}
			if resp.Error != nil {
				if ctx.Err() != nil {
					return nil // the stream's last word on its context ending
				}
				return pluginError(in, "fingerprint", resp.Error)
			}
			quiet = nil
			msg := fingerprintFromNomad(resp.Devices)
			in.known.set(msg)
			if err := send(msg); err != nil {
				return err
			}
		}
	}
}

// Stats forwards the Nomad plugin's statistics, translated, until ctx ends or its stream
// fails or ends (returned as an error: the host reopens it with backoff). Values of
// devices the last fingerprint did not report are left out: the host would refuse the
// whole message.
func (a *Adapter) Stats(ctx context.Context, interval time.Duration, send func(*pb.StatsResponse) error) error {
	in, err := a.current()
	if err != nil {
		return err
	}
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	ch, err := in.dev.Stats(ctx, interval)
	if err != nil {
		cancel()
		if parent.Err() != nil {
			return nil // ended by the caller while the stream was being opened
		}
		return pluginError(in, "stats", err)
	}
	defer stopStream(cancel, ch)
	for {
		select {
		case <-ctx.Done():
			return nil
		case resp, ok := <-ch:
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				return errors.New("stats: the Nomad plugin ended its stream")
			}
			if resp == nil {
				continue
			}
			if resp.Error != nil {
				if ctx.Err() != nil {
					return nil // the stream's last word on its context ending
				}
				return pluginError(in, "stats", resp.Error)
			}
			if err := send(statsFromNomad(resp.Groups, in.known.has, time.Now())); err != nil {
				return err
			}
		}
	}
}

// Reserve asks the Nomad plugin to reserve the devices, with ctx's deadline, and
// translates its answer. Nomad has no CDI device names, so there are none.
func (a *Adapter) Reserve(ctx context.Context, deviceIDs []string) (*pb.ContainerReservation, error) {
	in, err := a.current()
	if err != nil {
		return nil, err
	}
	resp, err := in.dev.raw.Reserve(ctx, &nproto.ReserveRequest{DeviceIds: deviceIDs})
	if err != nil {
		if in.dev.done.Err() != nil {
			return nil, errors.New("reserve: Nomad plugin " + in.path + " exited")
		}
		return nil, err // a gRPC status: the host keeps its code and message
	}
	return reservationFromNomad(resp.GetContainerRes()), nil
}

// stopStream ends a stream of Nomad's device client: it cancels the stream's context
// and reads what is left until the client closes the channel. The client's goroutine
// sends the stream's final error without watching the context, so a channel nobody
// reads would keep it forever. Canceling ends the gRPC stream at once, so this returns
// promptly.
func stopStream[T any](cancel context.CancelFunc, ch <-chan T) {
	cancel()
	for range ch {
	}
}

// knownDevices is the set of device IDs of the last fingerprint sent, for Stats. Safe
// for concurrent use.
type knownDevices struct {
	mu  sync.RWMutex
	ids map[string]bool
}

func (k *knownDevices) set(msg *pb.FingerprintResponse) {
	ids := make(map[string]bool)
	for _, g := range msg.GetGroups() {
		for _, d := range g.GetDevices() {
			ids[d.GetId()] = true
		}
	}
	k.mu.Lock()
	k.ids = ids
	k.mu.Unlock()
}

func (k *knownDevices) has(id string) bool {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.ids[id]
}

var _ device.DevicePlugin = (*nomadDevice)(nil)
