package nomadapi

// Self is what the shim reads of /v1/agent/self: the agent's statistics, whose
// "client" section names the node of a client agent.
type Self struct {
	Stats map[string]map[string]string `json:"stats"`
}

// NodeID is the ID of the agent's client node; "" for an agent that is no client.
func (s *Self) NodeID() string { return s.Stats["client"]["node_id"] }

// Client statuses of an allocation, as the client reports them (Nomad's
// structs.AllocClientStatus*).
const (
	ClientStatusPending  = "pending"
	ClientStatusRunning  = "running"
	ClientStatusComplete = "complete"
	ClientStatusFailed   = "failed"
	ClientStatusLost     = "lost"
	ClientStatusUnknown  = "unknown"
)

// Allocation is what the shim reads of a structs.Allocation.
type Allocation struct {
	ID            string
	Namespace     string
	JobID         string
	TaskGroup     string
	NodeID        string
	DesiredStatus string
	ClientStatus  string
	// AllocatedResources is nil for allocations made before Nomad 0.9.
	AllocatedResources *AllocatedResources
	CreateIndex        uint64
	ModifyIndex        uint64
}

// ClientTerminal reports whether the client is done with the allocation: complete,
// failed or lost (Nomad's Allocation.ClientTerminalStatus). Its tasks run no more.
func (a *Allocation) ClientTerminal() bool {
	switch a.ClientStatus {
	case ClientStatusComplete, ClientStatusFailed, ClientStatusLost:
		return true
	}
	return false
}

// AllocatedResources is the resources the scheduler gave the allocation.
type AllocatedResources struct {
	// Tasks maps a task's name to its resources.
	Tasks map[string]*AllocatedTaskResources
}

// AllocatedTaskResources is one task's resources.
type AllocatedTaskResources struct {
	Devices []*AllocatedDeviceResource
}

// AllocatedDeviceResource is the devices of one device block of a task: one Reserve
// call at the device plugin, with DeviceIDs.
type AllocatedDeviceResource struct {
	Vendor    string
	Type      string
	Name      string
	DeviceIDs []string
}
