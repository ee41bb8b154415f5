package rawgrpc

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strconv"
	"sync"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Client carries server-streaming gRPC calls on one HTTP/2 connection and reads them
// frame by frame: one goroutine (Run) reads every stream's messages and hands each to a
// callback as the bytes it arrived in, with no goroutine, buffer or decode per stream.
// It is a load generator's client: thousands of watchers on the agent's own machine
// cost the machine a fraction of what as many grpc-go client streams do, so that a
// benchmark measures the server. It speaks just enough HTTP/2 for that: it never sends
// more than a request of one DATA frame, answers the server's SETTINGS and PINGs, and
// keeps its receive windows open (a stream's at WindowSize, the connection's near
// 2^31), so the server is never held back by flow control.
//
// Open and Close may be called while Run runs, from any goroutine.
type Client struct {
	// MaxMessage bounds a message's length (0: DefaultMaxMessage): a longer one ends
	// Run with an error rather than be buffered. Set before Run.
	MaxMessage int

	nc net.Conn

	wmu  sync.Mutex // the writer side: bw, fr's writes, henc and hbuf
	bw   *bufio.Writer
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer
	next uint32 // the next stream ID

	mu      sync.Mutex
	streams map[uint32]*stream
}

// DefaultMaxMessage is the longest message a Client takes unless told otherwise.
const DefaultMaxMessage = 16 << 20

// WindowSize is a stream's receive window, as the client's SETTINGS announce it.
const WindowSize = 1 << 20

// connWindow is the connection's receive window once the client has opened it.
const connWindow = 1<<31 - 1

// stream is what Run keeps of an open stream.
type stream struct {
	pending  []byte // the start of a message split over DATA frames
	consumed int    // bytes taken since the last WINDOW_UPDATE of the stream
}

// Handler is what Run calls, on its own goroutine. Each function may be nil.
type Handler struct {
	// Headers is called when a stream's response headers arrive (the server's handler
	// took the call).
	Headers func(id uint32)
	// Message is called with each message of a stream; msg is valid only until it
	// returns.
	Message func(id uint32, msg []byte)
	// End is called once when a stream ends: nil for grpc-status 0, otherwise what the
	// trailers or a RST_STREAM said.
	End func(id uint32, err error)
}

// NewClient starts an HTTP/2 connection on nc (the client preface and SETTINGS). The
// client owns nc; Close closes it.
func NewClient(nc net.Conn) (*Client, error) {
	c := &Client{nc: nc, bw: bufio.NewWriterSize(nc, 64<<10), next: 1, streams: make(map[uint32]*stream)}
	c.fr = http2.NewFramer(c.bw, bufio.NewReaderSize(nc, 256<<10))
	c.fr.SetReuseFrames()
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.henc = hpack.NewEncoder(&c.hbuf)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.bw.WriteString(http2.ClientPreface); err != nil {
		return nil, err
	}
	if err := c.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 0}, http2.Setting{ID: http2.SettingInitialWindowSize, Val: WindowSize}); err != nil {
		return nil, err
	}
	if err := c.fr.WriteWindowUpdate(0, connWindow-65535); err != nil {
		return nil, err
	}
	return c, c.bw.Flush()
}

// Close closes the connection; Run then returns.
func (c *Client) Close() error { return c.nc.Close() }

// Open starts a call of method (e.g. "/pkg.Service/Method") with req, the request's
// encoded message, as its only one, and returns the stream's ID.
func (c *Client) Open(method string, req []byte) (uint32, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	id := c.next
	c.next += 2
	c.mu.Lock()
	c.streams[id] = &stream{}
	c.mu.Unlock()
	c.hbuf.Reset()
	for _, f := range [...]hpack.HeaderField{
		{Name: ":method", Value: "POST"},
		{Name: ":scheme", Value: "http"},
		{Name: ":path", Value: method},
		{Name: ":authority", Value: "localhost"},
		{Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"},
	} {
		if err := c.henc.WriteField(f); err != nil {
			return 0, err
		}
	}
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hbuf.Bytes(), EndHeaders: true}); err != nil {
		return 0, err
	}
	msg := make([]byte, 5+len(req))
	binary.BigEndian.PutUint32(msg[1:5], uint32(len(req)))
	copy(msg[5:], req)
	if err := c.fr.WriteData(id, true, msg); err != nil {
		return 0, err
	}
	return id, c.bw.Flush()
}

// Run reads the connection until it fails or is closed, calling h. It returns nil once
// Close was called, otherwise what ended it.
func (c *Client) Run(h Handler) error {
	var connConsumed int
	maxMsg := c.MaxMessage
	if maxMsg <= 0 {
		maxMsg = DefaultMaxMessage
	}
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		switch f := f.(type) {
		case *http2.DataFrame:
			id := f.StreamID
			s := c.stream(id)
			if s == nil {
				return fmt.Errorf("DATA on stream %d, which is not open", id)
			}
			n := int(f.Length)
			connConsumed += n
			s.consumed += n
			if err := c.deliver(s, id, f.Data(), maxMsg, h.Message); err != nil {
				return err
			}
			var connUpdate, streamUpdate int // window to give back; 0: none yet
			if connConsumed >= connWindow/2 {
				connUpdate, connConsumed = connConsumed, 0
			}
			if s.consumed >= WindowSize/2 && !f.StreamEnded() {
				streamUpdate, s.consumed = s.consumed, 0
			}
			if connUpdate > 0 || streamUpdate > 0 {
				update := func(id uint32, n int) error {
					if n == 0 {
						return nil
					}
					return c.fr.WriteWindowUpdate(id, uint32(n))
				}
				if err := c.write(func() error { return errors.Join(update(0, connUpdate), update(id, streamUpdate)) }); err != nil {
					return err
				}
			}
			if f.StreamEnded() {
				c.end(id, errors.New("the stream ended without trailers"), h.End)
			}
		case *http2.MetaHeadersFrame:
			id := f.StreamID
			if c.stream(id) == nil {
				return fmt.Errorf("HEADERS on stream %d, which is not open", id)
			}
			if !f.StreamEnded() {
				if st := f.PseudoValue("status"); st != "200" {
					c.end(id, fmt.Errorf("HTTP status %q", st), h.End)
				} else if h.Headers != nil {
					h.Headers(id)
				}
				continue
			}
			c.end(id, trailerError(f), h.End)
		case *http2.RSTStreamFrame:
			c.end(f.StreamID, fmt.Errorf("stream reset: %v", f.ErrCode), h.End)
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if err := c.write(c.fr.WriteSettingsAck); err != nil {
					return err
				}
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				data := f.Data
				if err := c.write(func() error { return c.fr.WritePing(true, data) }); err != nil {
					return err
				}
			}
		case *http2.GoAwayFrame:
			return fmt.Errorf("the server sent GOAWAY: %v %q", f.ErrCode, f.DebugData())
		}
	}
}

// deliver takes a DATA frame's payload for stream s, calling msg with every message it
// completes: straight from the payload when a message lies in it whole.
func (c *Client) deliver(s *stream, id uint32, p []byte, maxMsg int, msg func(uint32, []byte)) error {
	for len(p) > 0 {
		if len(s.pending) == 0 && len(p) >= 5 {
			n, err := messageLength(id, p, maxMsg)
			if err != nil {
				return err
			}
			if len(p) >= 5+n {
				if msg != nil {
					msg(id, p[5:5+n])
				}
				p = p[5+n:]
				continue
			}
		}
		s.pending = append(s.pending, p...)
		p = nil
		for len(s.pending) >= 5 {
			n, err := messageLength(id, s.pending, maxMsg)
			if err != nil {
				return err
			}
			if len(s.pending) < 5+n {
				break
			}
			if msg != nil {
				msg(id, s.pending[5:5+n])
			}
			s.pending = s.pending[:copy(s.pending, s.pending[5+n:])]
		}
	}
	return nil
}

// messageLength reads the 5-byte prefix that starts b, a message of stream id: the
// message's length, refused when it is compressed or longer than maxMsg.
func messageLength(id uint32, b []byte, maxMsg int) (int, error) {
	if b[0] != 0 {
		return 0, fmt.Errorf("stream %d: a compressed message (flag %d)", id, b[0])
	}
	n := int(binary.BigEndian.Uint32(b[1:5]))
	if n > maxMsg {
		return 0, fmt.Errorf("stream %d: a message of %d bytes, over the %d taken", id, n, maxMsg)
	}
	return n, nil
}

// trailerError is what a stream's trailers say: nil for grpc-status 0.
func trailerError(f *http2.MetaHeadersFrame) error {
	var status, message string
	for _, hf := range f.Fields {
		switch hf.Name {
		case "grpc-status":
			status = hf.Value
		case "grpc-message":
			message = hf.Value
		}
	}
	if status == "0" {
		return nil
	}
	if m, err := url.PathUnescape(message); err == nil {
		message = m
	}
	if _, err := strconv.Atoi(status); err != nil {
		return fmt.Errorf("trailers without a grpc-status (%q): %s", status, message)
	}
	return fmt.Errorf("grpc-status %s: %s", status, message)
}

// stream returns the open stream id, or nil.
func (c *Client) stream(id uint32) *stream {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.streams[id]
}

// end forgets stream id and tells end, once.
func (c *Client) end(id uint32, err error, end func(uint32, error)) {
	c.mu.Lock()
	_, open := c.streams[id]
	delete(c.streams, id)
	c.mu.Unlock()
	if open && end != nil {
		end(id, err)
	}
}

// write runs w (a write to the framer) and flushes, under the writer's lock.
func (c *Client) write(w func() error) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return errors.Join(w(), c.bw.Flush())
}
