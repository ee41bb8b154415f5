// Package nomadapi is a small typed client of the two Nomad HTTP API endpoints the shim
// reads: /v1/agent/self and a node's allocations (a blocking query). Nomad's own api
// module is not used (its v1.6 release is not a published module version); the shapes
// are those Nomad v1.6.3 encodes from nomad/structs, reduced to what the shim needs.
// Everything read is bounded (MaxResponseBytes, MaxAllocations): an answer over a bound
// is an error, never a partial answer. See docs/nomad.md#access-to-nomads-api.
package nomadapi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/devicehost/devicehost/textline"
)

// DefaultAddress is the Nomad agent's HTTP API when neither the config nor NOMAD_ADDR
// names one.
const DefaultAddress = "http://127.0.0.1:4646"

const (
	// MaxResponseBytes bounds one answer's body. A node's allocations embed their job,
	// tens of KiB each: 64 MiB is over a thousand large allocations.
	MaxResponseBytes = 64 << 20
	// MaxAllocations bounds the allocations of one answer (Nomad keeps a node's
	// terminal allocations until they are garbage collected).
	MaxAllocations = 10000
	// maxErrorBody bounds what of an error answer's body is read and quoted.
	maxErrorBody = 512
)

// Config says how to reach the Nomad agent, as Nomad's own CLI takes it. Zero fields are
// unset: FromEnv fills them from the environment, New then uses DefaultAddress and the
// system's roots.
type Config struct {
	// Address is http://host:port, https://host:port or unix:///path.
	Address string
	// Token is the ACL token's secret ID (X-Nomad-Token).
	Token string
	// CACert is a PEM file of the CA that signed the agent's certificate (https).
	CACert string
	// ClientCert and ClientKey are PEM files of a client certificate, for an agent that
	// verifies clients (tls { verify_https_client = true }).
	ClientCert string
	ClientKey  string
	// TLSServerName is the name the agent's certificate is checked against, when it
	// is not the address's host (Nomad's certificates name client.<region>.nomad).
	TLSServerName string
}

// FromEnv returns cfg with each unset field taken from the environment variable Nomad's
// CLI reads for it: NOMAD_ADDR, NOMAD_TOKEN, NOMAD_CACERT, NOMAD_CLIENT_CERT,
// NOMAD_CLIENT_KEY and NOMAD_TLS_SERVER_NAME. getenv is os.Getenv outside tests.
func FromEnv(cfg Config, getenv func(string) string) Config {
	fill := func(f *string, env string) {
		if *f == "" {
			*f = getenv(env)
		}
	}
	fill(&cfg.Address, "NOMAD_ADDR")
	fill(&cfg.Token, "NOMAD_TOKEN")
	fill(&cfg.CACert, "NOMAD_CACERT")
	fill(&cfg.ClientCert, "NOMAD_CLIENT_CERT")
	fill(&cfg.ClientKey, "NOMAD_CLIENT_KEY")
	fill(&cfg.TLSServerName, "NOMAD_TLS_SERVER_NAME")
	return cfg
}

// Client reads the Nomad HTTP API. Safe for concurrent use; it holds idle connections
// only, which CloseIdleConnections drops.
type Client struct {
	base     *url.URL // scheme and host of every request
	token    string
	http     *http.Client
	maxBytes int64 // MaxResponseBytes; tests lower it
}

// New returns a Client for cfg (DefaultAddress when cfg.Address is empty). It reads the
// TLS files now and reaches nothing: an address that is not http, https or unix, or TLS
// files that cannot be read, are errors naming the setting.
func New(cfg Config) (*Client, error) {
	if cfg.Address == "" {
		cfg.Address = DefaultAddress
	}
	u, err := url.Parse(cfg.Address)
	if err != nil || u.Host == "" && u.Scheme != "unix" || u.Opaque != "" {
		return nil, fmt.Errorf("nomad address %q: want http://host:port, https://host:port or unix:///path", cfg.Address)
	}
	tr := &http.Transport{
		Proxy:                 nil, // the local agent: never through a proxy
		MaxIdleConns:          2,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 0, // a blocking query answers late by design; each request has a deadline
	}
	base := &url.URL{Scheme: u.Scheme, Host: u.Host}
	switch u.Scheme {
	case "http":
	case "https":
		tc, err := tlsConfig(cfg)
		if err != nil {
			return nil, err
		}
		tr.TLSClientConfig = tc
	case "unix":
		path := u.Path
		if path == "" {
			return nil, fmt.Errorf("nomad address %q: no socket path", cfg.Address)
		}
		var d net.Dialer
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) { return d.DialContext(ctx, "unix", path) }
		base = &url.URL{Scheme: "http", Host: "nomad"}
	default:
		return nil, fmt.Errorf("nomad address %q: scheme %q: want http, https or unix", cfg.Address, u.Scheme)
	}
	return &Client{base: base, token: cfg.Token, http: &http.Client{Transport: tr}, maxBytes: MaxResponseBytes}, nil
}

// tlsConfig is the TLS client config of cfg: its CA (else the system's), its client
// certificate if any, its server name if set.
func tlsConfig(cfg Config) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.TLSServerName}
	if cfg.CACert != "" {
		pem, err := os.ReadFile(cfg.CACert)
		if err != nil {
			return nil, fmt.Errorf("nomad CA certificate: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("nomad CA certificate %s: no PEM certificate in it", cfg.CACert)
		}
		tc.RootCAs = pool
	}
	if (cfg.ClientCert == "") != (cfg.ClientKey == "") {
		return nil, errors.New("nomad client certificate: set both the certificate and its key, or neither")
	}
	if cfg.ClientCert != "" {
		cert, err := tls.LoadX509KeyPair(cfg.ClientCert, cfg.ClientKey)
		if err != nil {
			return nil, fmt.Errorf("nomad client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Address is the agent's address as requests reach it, for messages.
func (c *Client) Address() string { return c.base.String() }

// CloseIdleConnections closes the connections no request is using.
func (c *Client) CloseIdleConnections() { c.http.CloseIdleConnections() }

// StatusError is an answer other than 200: its HTTP status code and the start of its
// body, on one line with what is not printable escaped.
type StatusError struct {
	Code    int
	Message string
}

func (e *StatusError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("HTTP %d", e.Code)
	}
	return fmt.Sprintf("HTTP %d: %s", e.Code, e.Message)
}

// IsForbidden reports whether err is the agent refusing the token (403: a token
// without the policy's rights; 401: no token where one is required).
func IsForbidden(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && (se.Code == http.StatusForbidden || se.Code == http.StatusUnauthorized)
}

// Query is a blocking query's position: with Index > 0 the agent answers once the
// node's allocations change past Index, or after Wait (Nomad's default 5 minutes when
// zero, plus up to 1/16 of jitter). Index 0 answers at once.
type Query struct {
	Index uint64
	Wait  time.Duration
}

// Meta is what an answer says besides its body.
type Meta struct {
	// Index is X-Nomad-Index: the index to pass to the next blocking query.
	Index uint64
}

// Self reads /v1/agent/self.
func (c *Client) Self(ctx context.Context) (*Self, error) {
	var s Self
	_, err := c.get(ctx, "/v1/agent/self", nil, func(r io.Reader) error {
		return json.NewDecoder(r).Decode(&s)
	})
	if err != nil {
		return nil, fmt.Errorf("read the Nomad agent (/v1/agent/self): %w", err)
	}
	return &s, nil
}

// NodeAllocations reads the allocations Nomad placed on the node nodeID, every client
// status included, as a blocking query at q. It waits at most q.Wait and its jitter
// plus ctx's deadline allows.
func (c *Client) NodeAllocations(ctx context.Context, nodeID string, q Query) ([]Allocation, Meta, error) {
	params := url.Values{}
	if q.Index > 0 {
		params.Set("index", strconv.FormatUint(q.Index, 10))
		if q.Wait > 0 {
			params.Set("wait", q.Wait.String())
		}
	}
	var allocs []Allocation
	meta, err := c.get(ctx, "/v1/node/"+url.PathEscape(nodeID)+"/allocations", params, func(r io.Reader) error {
		var err error
		allocs, err = decodeAllocations(r)
		return err
	})
	if err != nil {
		return nil, Meta{}, fmt.Errorf("read the node's allocations: %w", err)
	}
	return allocs, meta, nil
}

// decodeAllocations decodes a JSON array of allocations one at a time (an allocation's
// job is skipped as it is read, never held), refusing more than MaxAllocations.
func decodeAllocations(r io.Reader) ([]Allocation, error) {
	dec := json.NewDecoder(r)
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if tok == nil {
		return nil, nil // null
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return nil, fmt.Errorf("decode: want an array of allocations, got %v", tok)
	}
	var out []Allocation
	for dec.More() {
		if len(out) == MaxAllocations {
			return nil, fmt.Errorf("more than %d allocations", MaxAllocations)
		}
		var a Allocation
		if err := dec.Decode(&a); err != nil {
			return nil, fmt.Errorf("decode allocation %d: %w", len(out), err)
		}
		out = append(out, a)
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	return out, nil
}

// get does one GET of path?params and hands a 200 answer's body, cut at
// MaxResponseBytes (reading past it is an error), to decode.
func (c *Client) get(ctx context.Context, path string, params url.Values, decode func(io.Reader) error) (Meta, error) {
	u := *c.base
	u.Path = path
	u.RawQuery = params.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return Meta{}, err
	}
	if c.token != "" {
		req.Header.Set("X-Nomad-Token", c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return Meta{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		return Meta{}, &StatusError{Code: resp.StatusCode, Message: textline.Escape(strings.TrimSpace(string(body)), maxErrorBody)}
	}
	var meta Meta
	if s := resp.Header.Get("X-Nomad-Index"); s != "" {
		if meta.Index, err = strconv.ParseUint(s, 10, 64); err != nil {
			return Meta{}, fmt.Errorf("X-Nomad-Index %s: not an index", textline.Escape(s, 40))
		}
	}
	lr := &limitReader{r: resp.Body, left: c.maxBytes}
	if err := decode(lr); err != nil {
		if lr.over {
			return Meta{}, fmt.Errorf("answer larger than %d bytes", c.maxBytes)
		}
		return Meta{}, err
	}
	return meta, nil
}

// limitReader reads at most left bytes of r, then fails, remembering that it did.
type limitReader struct {
	r    io.Reader
	left int64
	over bool
}

var errTooLarge = errors.New("answer too large")

func (l *limitReader) Read(p []byte) (int, error) {
	if l.left <= 0 {
		// One byte more tells a body of exactly the limit from a longer one.
		var b [1]byte
		n, err := l.r.Read(b[:])
		if n > 0 {
			l.over = true
			return 0, errTooLarge
		}
		return 0, err
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	return n, err
}
