// Package fanout sends the host API's server streams (Fingerprint, Stats): one Manager
// subscription per kind of stream, each value encoded once per filter into an immutable
// Frame, and sent to every stream by a bounded number of goroutines, latest-value and
// paced, so that a slow or stuck client blocks no one. Its Codec is the server's gRPC
// codec: it sends a Frame's bytes as they are, and with StrictServices lets a handler
// answer a request that does not decode INVALID_ARGUMENT rather than grpc-go's INTERNAL.
// It is package server's; nothing else serves the host API.
//
// Concurrency and cleanup. A stream's handler calls Feeds.Join, then Sub.Start (which
// sends its first message on the handler's goroutine and hands the stream over to the
// feed), then waits for Sub.Failed, Sub.Gone or its own end, and calls Sub.Leave in every
// case, Start or not; Leave returns once no goroutine is sending on the stream, so the
// handler may return. One goroutine at a time sends on a stream. The feed's goroutine
// starts with its first stream and ends when its last stream leaves, the Manager closes
// the subscription, or the quit channel given to NewFeeds closes; each change's sends
// run on at most fanoutWorkers goroutines of their own, and one left to a stuck send
// ends when that send returns. The owner closes quit, stops its gRPC server (so that
// every send returns), and calls Feeds.Close, which refuses later joins and waits for
// all of those goroutines. Feeds, Sub's exported methods and Codec are safe for
// concurrent use; a Frame is never modified once made.
package fanout
