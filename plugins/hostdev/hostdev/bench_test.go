package hostdev

import (
	"testing"
	"time"

	pb "github.com/devicehost/devicehost/proto/deviceplugin/v1"
)

// BenchmarkHotplug measures how long after a node goes its devices are reported
// unhealthy, and after it comes back healthy again, through the plugin's watch (one op:
// one removal and one return). It reports each as ms per transition.
func BenchmarkHotplug(b *testing.B) {
	tr := newTree(b)
	tr.mknod("/dev/fuse", 10, 229)
	s := start(b, tr.config(map[string]DeviceConfig{"fuse": {Paths: []string{"/dev/fuse"}, Count: 8}}))
	s.WaitFor(b, "fuse-0 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-0")) })
	var gone, back time.Duration
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		tr.rm("/dev/fuse")
		s.WaitFor(b, "fuse-0 unhealthy", func(r *pb.FingerprintResponse) bool { return !healthy(device(r, "fuse-0")) })
		t1 := time.Now()
		tr.mknod("/dev/fuse", 10, 229)
		s.WaitFor(b, "fuse-0 healthy", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "fuse-0")) })
		gone += t1.Sub(t0)
		back += time.Since(t1)
	}
	b.ReportMetric(float64(gone.Microseconds())/1000/float64(b.N), "ms/removal")
	b.ReportMetric(float64(back.Microseconds())/1000/float64(b.N), "ms/return")
}

// BenchmarkUSBReplug measures how long after a USB device is plugged in again under
// another port and number its ID is healthy again (one op: unplug, then re-plug).
func BenchmarkUSBReplug(b *testing.B) {
	tr := newTree(b)
	stick := usbDevice{name: "1-1", vendor: "10c4", product: "ea60", serial: "0001", devnum: 4, tty: "ttyUSB0"}
	tr.plug(stick)
	s := start(b, tr.config(map[string]DeviceConfig{"zigbee": {USB: &USBConfig{Vendor: "10c4", Product: "ea60", Serial: "0001"}}}))
	s.WaitFor(b, "the stick", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "zigbee-0001")) })
	var replug time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		tr.unplug(stick)
		s.WaitFor(b, "unplugged", func(r *pb.FingerprintResponse) bool { return !healthy(device(r, "zigbee-0001")) })
		// Every other round on the other port, with the next bus number.
		stick.name, stick.devnum = []string{"1-1", "1-4"}[i%2], 4+(i+1)%200
		t0 := time.Now()
		tr.plug(stick)
		s.WaitFor(b, "re-plugged", func(r *pb.FingerprintResponse) bool { return healthy(device(r, "zigbee-0001")) })
		replug += time.Since(t0)
	}
	b.ReportMetric(float64(replug.Microseconds())/1000/float64(b.N), "ms/replug")
}
