// Package nomadtest is a stand-in for a Nomad client agent's HTTP API, for tests: it
// serves /v1/agent/self and /v1/node/<id>/allocations (as blocking queries, with
// X-Nomad-Index) from Nomad v1.6.3's own nomad/structs values, JSON-encoded with the
// codec handle Nomad's HTTP server uses, and can answer 403 or 5xx, or be down. It
// changes allocations the way a Nomad client and its servers do on an alloc stop, a
// job stop, a drain and a client restart.
package nomadtest

import (
	"bytes"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/codec"
	"github.com/hashicorp/nomad/helper/uuid"
	"github.com/hashicorp/nomad/nomad/mock"
	"github.com/hashicorp/nomad/nomad/structs"
)

// Server is the stand-in. Its methods are safe for concurrent use.
type Server struct {
	t    testing.TB
	addr string // host:port, kept across Stop and Start

	mu     sync.Mutex
	srv    *http.Server
	node   *structs.Node
	allocs []*structs.Allocation // in placement order
	index  uint64                // the servers' Raft index
	// allocsIndex is the last index that changed the allocations (a removal too).
	allocsIndex uint64
	changed     chan struct{} // closed (and replaced) at every change
	fail        *Failure
	requests    []Request
}

// Failure is an answer the stand-in gives to every request instead of the real one.
type Failure struct {
	Code int
	Body string
}

// Request is one request the stand-in answered.
type Request struct {
	Path  string
	Index string // the index parameter, "" if none
	Wait  string
	Token string
}

// New starts a stand-in for node (mock.NvidiaNode's shape when nil), stopped at
// cleanup.
func New(t testing.TB, node *structs.Node) *Server {
	t.Helper()
	if node == nil {
		node = mock.NvidiaNode()
	}
	s := &Server{t: t, node: node, index: 10, changed: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.addr = ln.Addr().String()
	s.serve(ln)
	t.Cleanup(s.Stop)
	return s
}

// URL is the stand-in's address, http://127.0.0.1:port.
func (s *Server) URL() string { return "http://" + s.addr }

// NodeID is the ID of the stand-in's node.
func (s *Server) NodeID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.node.ID
}

func (s *Server) serve(ln net.Listener) {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/agent/self", s.self)
	mux.HandleFunc("/v1/node/", s.nodeAllocations)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	go func() { _ = srv.Serve(ln) }()
}

// Stop takes the agent down: its port refuses connections and the queries in flight
// fail, as when a Nomad client stops. Safe to call when stopped.
func (s *Server) Stop() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

// Start brings the agent back on the same address, with the same node and
// allocations (a client restart keeps its allocations and their IDs).
func (s *Server) Start() {
	s.t.Helper()
	var ln net.Listener
	var err error
	for range 50 { // the old socket may linger a moment
		if ln, err = net.Listen("tcp", s.addr); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		s.t.Fatalf("restart the Nomad stand-in on %s: %v", s.addr, err)
	}
	s.serve(ln)
}

// Fail makes every answer f (nil: answer again).
func (s *Server) Fail(f *Failure) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = f
	s.wakeLocked() // queries in flight answer now
}

// Requests returns the requests answered so far.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.requests)
}

// AllocationsIndex is the X-Nomad-Index the node's allocations answer now.
func (s *Server) AllocationsIndex() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, idx := s.resultLocked(s.node.ID)
	return idx
}

// Index is the stand-in's current Raft index.
func (s *Server) Index() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.index
}

// bumpLocked advances the index and wakes blocking queries.
func (s *Server) bumpLocked() uint64 {
	s.index++
	s.wakeLocked()
	return s.index
}

// wakeLocked makes blocking queries look again.
func (s *Server) wakeLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// Alloc returns an allocation of mock.BatchAlloc's shape for namespace/job whose task
// holds one device block of devices (nvidia/gpu/name), pending on the client, as
// Nomad's scheduler places it.
func Alloc(namespace, job, task, name string, devices ...string) *structs.Allocation {
	a := mock.BatchAlloc()
	a.ID = uuid.Generate()
	a.Namespace = namespace
	a.Job.ID, a.Job.Name, a.Job.Namespace = job, job, namespace
	a.JobID = job
	a.Job.TaskGroups[0].Tasks[0].Name = task
	a.TaskGroup = a.Job.TaskGroups[0].Name
	a.Name = job + "." + a.TaskGroup + "[0]"
	web := a.AllocatedResources.Tasks["web"]
	delete(a.AllocatedResources.Tasks, "web")
	web.Devices = []*structs.AllocatedDeviceResource{{Vendor: "nvidia", Type: "gpu", Name: name, DeviceIDs: devices}}
	a.AllocatedResources.Tasks[task] = web
	a.TaskResources = nil
	a.ClientStatus = structs.AllocClientStatusPending
	a.DesiredStatus = structs.AllocDesiredStatusRun
	return a
}

// Place puts a on the node (its NodeID set) and returns its ID.
func (s *Server) Place(a *structs.Allocation) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	a.NodeID, a.NodeName = s.node.ID, s.node.Name
	idx := s.bumpLocked()
	s.allocsIndex = idx
	a.CreateIndex, a.ModifyIndex, a.AllocModifyIndex = idx, idx, idx
	s.allocs = append(s.allocs, a)
	return a.ID
}

// Update changes the allocation id with change, as one write of the servers.
func (s *Server) Update(id string, change func(*structs.Allocation)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := slices.IndexFunc(s.allocs, func(a *structs.Allocation) bool { return a.ID == id })
	if i < 0 {
		s.t.Errorf("nomadtest: no allocation %s", id)
		return
	}
	a := s.allocs[i].Copy()
	change(a)
	a.ModifyIndex = s.bumpLocked()
	s.allocsIndex = a.ModifyIndex
	s.allocs[i] = a
}

// SetClientStatus is the client reporting status for the allocation id (its tasks
// running, or done: complete, failed), with the task states that go with it.
func (s *Server) SetClientStatus(id, status string) {
	s.Update(id, func(a *structs.Allocation) {
		a.ClientStatus = status
		state := structs.TaskStateRunning
		switch status {
		case structs.AllocClientStatusPending:
			state = structs.TaskStatePending
		case structs.AllocClientStatusComplete, structs.AllocClientStatusFailed, structs.AllocClientStatusLost:
			state = structs.TaskStateDead
		}
		a.TaskStates = map[string]*structs.TaskState{}
		for task := range a.AllocatedResources.Tasks {
			a.TaskStates[task] = &structs.TaskState{State: state, Failed: status == structs.AllocClientStatusFailed, StartedAt: time.Now()}
		}
	})
}

// StopAlloc is `nomad alloc stop`: the servers mark the allocation to stop, then the
// client stops its tasks and reports it complete.
func (s *Server) StopAlloc(id string) {
	s.Update(id, func(a *structs.Allocation) {
		a.DesiredStatus = structs.AllocDesiredStatusStop
		a.DesiredDescription = "alloc was stopped by the user"
		a.DesiredTransition.Migrate = new(bool)
	})
	s.SetClientStatus(id, structs.AllocClientStatusComplete)
}

// StopJob is `nomad job stop`: every allocation of the job on the node is marked to
// stop, then reported complete by the client. It returns their IDs.
func (s *Server) StopJob(namespace, job string) []string {
	ids := s.allocIDs(func(a *structs.Allocation) bool { return a.Namespace == namespace && a.JobID == job })
	for _, id := range ids {
		s.Update(id, func(a *structs.Allocation) {
			a.DesiredStatus = structs.AllocDesiredStatusStop
			a.DesiredDescription = "alloc not needed due to job update"
			a.Job.Stop = true
		})
	}
	for _, id := range ids {
		s.SetClientStatus(id, structs.AllocClientStatusComplete)
	}
	return ids
}

// StartDrain is `nomad node drain -enable`: the node gets a drain strategy and is
// ineligible, and its allocations are marked to migrate and stop (the client keeps
// running them until it stops them: FinishDrain).
func (s *Server) StartDrain() []string {
	s.mu.Lock()
	s.node.DrainStrategy = &structs.DrainStrategy{DrainSpec: structs.DrainSpec{Deadline: time.Hour}}
	s.node.SchedulingEligibility = structs.NodeSchedulingIneligible
	s.bumpLocked()
	s.mu.Unlock()
	ids := s.allocIDs(func(a *structs.Allocation) bool { return !a.ClientTerminalStatus() })
	for _, id := range ids {
		s.Update(id, func(a *structs.Allocation) {
			a.DesiredTransition.Migrate = new(bool)
			*a.DesiredTransition.Migrate = true
			a.DesiredStatus = structs.AllocDesiredStatusStop
			a.DesiredDescription = "alloc is being migrated"
		})
	}
	return ids
}

// FinishDrain is the client stopping the draining allocations (reported complete) and
// the drain ending.
func (s *Server) FinishDrain() {
	ids := s.allocIDs(func(a *structs.Allocation) bool {
		return !a.ClientTerminalStatus() && a.DesiredStatus == structs.AllocDesiredStatusStop
	})
	for _, id := range ids {
		s.SetClientStatus(id, structs.AllocClientStatusComplete)
	}
	s.mu.Lock()
	s.node.DrainStrategy = nil
	s.node.LastDrain = &structs.DrainMetadata{Status: structs.DrainStatusComplete}
	s.bumpLocked()
	s.mu.Unlock()
}

// GC removes the allocation id, as the servers' garbage collection does.
func (s *Server) GC(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.allocs = slices.DeleteFunc(s.allocs, func(a *structs.Allocation) bool { return a.ID == id })
	s.allocsIndex = s.bumpLocked()
}

func (s *Server) allocIDs(match func(*structs.Allocation) bool) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for _, a := range s.allocs {
		if match(a) {
			ids = append(ids, a.ID)
		}
	}
	return ids
}

// record notes r and returns the failure to answer with, if any.
func (s *Server) record(r *http.Request) *Failure {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := r.URL.Query()
	s.requests = append(s.requests, Request{Path: r.URL.Path, Index: q.Get("index"), Wait: q.Get("wait"), Token: r.Header.Get("X-Nomad-Token")})
	return s.fail
}

// agentSelf is command/agent's agentSelf answer, its config reduced to a few fields.
type agentSelf struct {
	Config map[string]any               `json:"config"`
	Member map[string]any               `json:"member,omitempty"`
	Stats  map[string]map[string]string `json:"stats"`
}

func (s *Server) self(w http.ResponseWriter, r *http.Request) {
	if f := s.record(r); f != nil {
		http.Error(w, f.Body, f.Code)
		return
	}
	s.mu.Lock()
	self := agentSelf{
		Config: map[string]any{"Region": "global", "Datacenter": s.node.Datacenter, "NodeName": s.node.Name,
			"Client": map[string]any{"Enabled": true, "NodeClass": s.node.NodeClass}},
		Member: map[string]any{"Name": "", "Addr": nil, "Port": 0, "Tags": nil, "Status": "none"},
		Stats: map[string]map[string]string{
			"client": {"node_id": s.node.ID, "known_servers": "127.0.0.1:4647",
				"num_allocations": strconv.Itoa(len(s.allocs)), "last_heartbeat": "1.2s", "heartbeat_ttl": "15s"},
			"runtime": {"arch": "amd64", "version": "go1.20.10", "goroutines": "100"},
		},
	}
	s.mu.Unlock()
	s.write(w, 0, self)
}

// nodeAllocations is Node.GetAllocs as the HTTP agent serves it: a blocking query on
// the index, the list in placement order, X-Nomad-Index the highest ModifyIndex.
func (s *Server) nodeAllocations(w http.ResponseWriter, r *http.Request) {
	rest := strings.TrimPrefix(r.URL.Path, "/v1/node/")
	nodeID, ok := strings.CutSuffix(rest, "/allocations")
	if !ok {
		http.NotFound(w, r)
		return
	}
	if f := s.record(r); f != nil {
		http.Error(w, f.Body, f.Code)
		return
	}
	q := r.URL.Query()
	var minIndex uint64
	if v := q.Get("index"); v != "" {
		var err error
		if minIndex, err = strconv.ParseUint(v, 10, 64); err != nil {
			http.Error(w, "Invalid index", http.StatusBadRequest)
			return
		}
	}
	wait := 5 * time.Minute
	if v := q.Get("wait"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			http.Error(w, "Invalid wait time", http.StatusBadRequest)
			return
		}
		wait = d
	}
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		f := s.fail
		out, index := s.resultLocked(nodeID)
		changed := s.changed
		s.mu.Unlock()
		switch {
		case f != nil:
			http.Error(w, f.Body, f.Code)
			return
		case minIndex == 0 || index > minIndex:
			s.write(w, index, out)
			return
		}
		select {
		case <-changed:
		case <-deadline.C:
			minIndex = 0 // the wait is over: answer what there is
		case <-r.Context().Done():
			return
		}
	}
}

// resultLocked is Node.GetAllocs's answer for nodeID: the node's allocations in
// placement order and the highest ModifyIndex among them, or the allocs table's index
// when there are none. Called with mu held.
func (s *Server) resultLocked(nodeID string) ([]*structs.Allocation, uint64) {
	out := make([]*structs.Allocation, 0, len(s.allocs))
	var index uint64
	for _, a := range s.allocs {
		if a.NodeID == nodeID {
			c := a.Copy()
			c.SetEventDisplayMessages()
			out = append(out, c)
			index = max(index, a.ModifyIndex)
		}
	}
	if len(out) == 0 {
		index = max(s.allocsIndex, 1)
	}
	return out, index
}

// write encodes v as Nomad's HTTP server does (structs.JsonHandleWithExtensions),
// with X-Nomad-Index when index > 0.
func (s *Server) write(w http.ResponseWriter, index uint64, v any) {
	var buf bytes.Buffer
	if err := codec.NewEncoder(&buf, structs.JsonHandleWithExtensions).Encode(v); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if index > 0 {
		w.Header().Set("X-Nomad-Index", strconv.FormatUint(index, 10))
		w.Header().Set("X-Nomad-KnownLeader", "true")
		w.Header().Set("X-Nomad-LastContact", "0")
	}
	_, _ = w.Write(buf.Bytes())
}
