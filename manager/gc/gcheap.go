package gc

import "container/heap"

// itemHeap is a min-heap of GC items under less that tracks each item's place, so any
// item can be removed in O(log n). An item is in at most one itemHeap at a time, the
// one its heap field names.
type itemHeap struct {
	id    heapID
	items []*gcItem
	less  func(a, b *gcItem) bool
}

// heapID names one of a gcRun's heaps.
type heapID uint8

const (
	heapNone heapID = iota
	heapClean
	heapPending
	heapWaiting
)

func (h *itemHeap) add(it *gcItem) {
	it.heap = h.id
	heap.Push(h, it)
}

func (h *itemHeap) remove(it *gcItem) {
	heap.Remove(h, it.pos)
	it.heap = heapNone
}

// peek returns the least item, or nil.
func (h *itemHeap) peek() *gcItem {
	if len(h.items) == 0 {
		return nil
	}
	return h.items[0]
}

// heap.Interface, for container/heap only.

func (h *itemHeap) Len() int           { return len(h.items) }
func (h *itemHeap) Less(i, j int) bool { return h.less(h.items[i], h.items[j]) }

func (h *itemHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].pos, h.items[j].pos = i, j
}

func (h *itemHeap) Push(x any) {
	it := x.(*gcItem)
	it.pos = len(h.items)
	h.items = append(h.items, it)
}

func (h *itemHeap) Pop() any {
	n := len(h.items) - 1
	it := h.items[n]
	h.items[n] = nil
	h.items = h.items[:n]
	return it
}
