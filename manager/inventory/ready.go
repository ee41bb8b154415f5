package inventory

// Readiness: Ready is closed once every plugin has settled (fingerprinted, had a
// fingerprint refused, failed a run, or is configured without a binary), or when the
// manager forces it. Started is closed earlier, once every plugin has been launched
// (and so accepted its config) or settled. Once closed they stay closed.

// Started is closed once every plugin has been launched or has settled, or Ready was
// forced: each plugin has accepted or rejected its config, or failed to start.
func (r *Registry) Started() <-chan struct{} { return r.started }

// checkStartedLocked closes started once every plugin has run or settled.
func (r *Registry) checkStartedLocked() {
	for _, rec := range r.plugins {
		if !rec.settled && !rec.running {
			return
		}
	}
	r.markStartedLocked()
}

func (r *Registry) markStartedLocked() {
	if !r.isStarted {
		r.isStarted = true
		close(r.started)
	}
}

// Ready is closed once every plugin has settled, or ForceReady was called.
func (r *Registry) Ready() <-chan struct{} { return r.ready }

// CheckReady closes Ready if every plugin has settled (or there are none).
func (r *Registry) CheckReady() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.checkReadyLocked()
}

// ForceReady closes Ready whatever the plugins' state, and returns the plugins that had
// not settled.
func (r *Registry) ForceReady() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var waiting []string
	for _, name := range r.names {
		if !r.plugins[name].settled {
			waiting = append(waiting, name)
		}
	}
	r.markReadyLocked()
	return waiting
}

// checkReadyLocked closes ready once every plugin has settled (and started, once every
// plugin has run or settled).
func (r *Registry) checkReadyLocked() {
	r.checkStartedLocked()
	for _, rec := range r.plugins {
		if !rec.settled {
			return
		}
	}
	r.markReadyLocked()
}

func (r *Registry) markReadyLocked() {
	r.markStartedLocked()
	if !r.isReady {
		r.isReady = true
		close(r.ready)
	}
}
