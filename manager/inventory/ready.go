package inventory

// Readiness: Ready is closed once every plugin has settled (fingerprinted, had a
// fingerprint refused, failed a run, or is configured without a binary), or when the
// manager forces it. Once closed it stays closed.

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

// checkReadyLocked closes ready once every plugin has settled.
func (r *Registry) checkReadyLocked() {
	for _, rec := range r.plugins {
		if !rec.settled {
			return
		}
	}
	r.markReadyLocked()
}

func (r *Registry) markReadyLocked() {
	if !r.isReady {
		r.isReady = true
		close(r.ready)
	}
}
