// Package fanout sends the host API's server streams (Fingerprint, Stats): one Manager
// subscription per kind of stream, each value encoded once per filter into an immutable
// Frame and sent to every stream by a bounded number of goroutines, latest-value and
// paced, so that a slow or stuck client blocks no one. Its Codec is the server's gRPC
// codec. It is package server's; Feeds states the concurrency and cleanup contract,
// and docs/api.md#fan-out what clients see.
package fanout
