package server

import (
	"slices"
	"strconv"
	"strings"

	"github.com/devicehost/devicehost/device"
	pb "github.com/devicehost/devicehost/proto/devicehost/v1"
	"github.com/devicehost/devicehost/validate"
)

// streamFilter selects the groups a Fingerprint or Stats stream sends: a group must be
// owned by one of plugins (when any are given) and match one of groups (when any are
// given). Immutable once made.
type streamFilter struct {
	plugins []string          // sorted, without duplicates
	groups  []device.GroupKey // sorted, without duplicates; an empty field matches anything
}

// newStreamFilter converts a request's filter fields, once validate.StreamFilter
// accepts them.
func newStreamFilter(groups []*pb.GroupFilter, plugins []string) (streamFilter, error) {
	if err := validate.StreamFilter(len(groups), len(plugins)); err != nil {
		return streamFilter{}, err
	}
	var f streamFilter
	for _, g := range groups {
		f.groups = append(f.groups, device.GroupKey{Vendor: g.GetVendor(), Type: g.GetType(), Name: g.GetName()})
	}
	slices.SortFunc(f.groups, func(a, b device.GroupKey) int {
		return strings.Compare(a.Vendor+"\x00"+a.Type+"\x00"+a.Name, b.Vendor+"\x00"+b.Type+"\x00"+b.Name)
	})
	f.groups = slices.Compact(f.groups)
	f.plugins = slices.Compact(slices.Sorted(slices.Values(plugins)))
	return f, nil
}

// key identifies the filter: two requests that select the same groups the same way have
// the same key, so their streams share one encoding of each message.
func (f streamFilter) key() string {
	var b strings.Builder
	for _, p := range f.plugins {
		b.WriteString(strconv.Quote(p))
	}
	b.WriteByte('|')
	for _, g := range f.groups {
		b.WriteString(strconv.Quote(g.Vendor))
		b.WriteString(strconv.Quote(g.Type))
		b.WriteString(strconv.Quote(g.Name))
	}
	return b.String()
}

// matches reports whether the group key of plugin passes the filter.
func (f streamFilter) matches(plugin string, key device.GroupKey) bool {
	if len(f.plugins) > 0 {
		if _, found := slices.BinarySearch(f.plugins, plugin); !found {
			return false
		}
	}
	if len(f.groups) == 0 {
		return true
	}
	for _, g := range f.groups {
		if (g.Vendor == "" || g.Vendor == key.Vendor) &&
			(g.Type == "" || g.Type == key.Type) &&
			(g.Name == "" || g.Name == key.Name) {
			return true
		}
	}
	return false
}
