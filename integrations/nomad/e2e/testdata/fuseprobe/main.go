// Command fuseprobe is the program of TestNomadAgentHostDev's exec tasks: static, so
// that it runs alone in a chroot, it prints one line saying what /dev/fuse is there
// ("FUSE_NODE <major>:<minor>" for a character device, else FUSE_NO_NODE) and whether
// it opens read-write (FUSE_OK, else FUSE_OPEN_FAILED and the error), then waits for
// SIGINT or SIGTERM.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

func main() {
	node := "FUSE_NO_NODE"
	var st unix.Stat_t
	if err := unix.Stat("/dev/fuse", &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR {
		node = fmt.Sprintf("FUSE_NODE %d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	open := "FUSE_OK"
	if f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0); err != nil {
		open = "FUSE_OPEN_FAILED " + err.Error()
	} else {
		f.Close()
	}
	fmt.Println(node, open)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
