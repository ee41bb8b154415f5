package supervise

// repeats collapses a message seen again and again in a row into one log line and a
// count: see says whether a message is new (to be logged) and, when it replaces one seen
// more than once, how many times that one came. Owned by one goroutine.
type repeats struct {
	last  string
	count int // times last came in a row
}

// see records msg; isNew is whether it differs from the previous one, and when it
// does, prev and times are the previous message and its count in a row.
func (r *repeats) see(msg string) (isNew bool, prev string, times int) {
	if r.count > 0 && msg == r.last {
		r.count++
		return false, "", 0
	}
	prev, times = r.last, r.count
	r.last, r.count = msg, 1
	return true, prev, times
}

// reset forgets the current message (the condition ended) and returns it with its
// count in a row.
func (r *repeats) reset() (prev string, times int) {
	prev, times = r.last, r.count
	r.last, r.count = "", 0
	return prev, times
}
