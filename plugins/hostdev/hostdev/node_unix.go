//go:build unix

package hostdev

import (
	"io/fs"
	"syscall"

	"golang.org/x/sys/unix"
)

// deviceNumbers are a device node's major and minor numbers.
func deviceNumbers(info fs.FileInfo) (major, minor uint32, ok bool) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	rdev := uint64(st.Rdev) //nolint:unconvert // int32 on some systems
	return unix.Major(rdev), unix.Minor(rdev), true
}
