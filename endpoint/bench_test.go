package endpoint

import (
	"runtime"
	"testing"

	"google.golang.org/grpc/mem"
)

// BenchmarkReceiveBuffer gathers a 51 KB message (a Fingerprint of 8 GPUs with
// on-demand MIG) from the 16 KB HTTP/2 frames it arrives in, into one buffer as grpc-go's
// proto codec does before decoding, from grpc-go's default pool and from
// clientBufferPool; "/gc" collects garbage every third message, as a watcher of such
// snapshots does (not timed; it empties the pools).
func BenchmarkReceiveBuffer(b *testing.B) {
	frame := make([]byte, 16<<10)
	var msg mem.BufferSlice
	for range 3 {
		msg = append(msg, mem.SliceBuffer(frame))
	}
	msg = append(msg, mem.SliceBuffer(frame[:51433-3*len(frame)]))
	for _, pool := range []struct {
		name string
		p    mem.BufferPool
	}{{"default", mem.DefaultBufferPool()}, {"client", clientBufferPool}} {
		for _, gc := range []bool{false, true} {
			name := pool.name
			if gc {
				name += "/gc"
			}
			b.Run(name, func(b *testing.B) {
				n := 0
				for b.Loop() {
					buf := msg.MaterializeToBuffer(pool.p)
					if buf.Len() != 51433 {
						b.Fatalf("gathered %d bytes, want 51433", buf.Len())
					}
					buf.Free()
					if n++; gc && n%3 == 0 {
						b.StopTimer()
						runtime.GC()
						b.StartTimer()
					}
				}
			})
		}
	}
}
