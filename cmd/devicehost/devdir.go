package main

// devDirPrefix starts the name of -dev's temporary directory (os.MkdirTemp's pattern).
const devDirPrefix = "devicehost-dev-"

// devLockName is the file in -dev's temporary directory that its agent holds an
// exclusive flock on while it runs. The kernel drops the lock when the process dies,
// however it dies, so a directory whose lock can be taken belongs to no running agent.
const devLockName = "dev.lock"

// devSocketName and devStateName are where -dev puts its socket and state in the
// directory, unless -listen or -state-dir say otherwise.
const (
	devSocketName   = "devicehost.sock"
	devStateName    = "state"
	devSimStateName = "nvidia-sim.json" // the simulated machine's MIG state
)
