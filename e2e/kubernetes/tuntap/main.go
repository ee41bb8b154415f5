// Command tuntap is the e2e pods' TUN check: it opens /dev/net/tun, creates a TUN
// interface with it (ioctl TUNSETIFF, as ip tuntap and VPN clients do) and prints
// TUN=<interface> when the interface is there, or TUN_FAILED=<error>. A static binary:
// the pods' busybox has no ip tuntap.
package main

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

func main() {
	name, err := createTUN()
	if err != nil {
		fmt.Printf("TUN_FAILED=%v\n", err)
		return
	}
	fmt.Printf("TUN=%s\n", name)
}

func createTUN() (string, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open /dev/net/tun: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("dhtun%d")
	if err != nil {
		return "", err
	}
	ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return "", fmt.Errorf("TUNSETIFF: %w", err)
	}
	name := ifr.Name()
	// The interface lives while fd is open: it is in the pod's network namespace now.
	if _, err := os.Stat("/sys/class/net/" + name); err != nil {
		return "", fmt.Errorf("interface %s made but not listed: %w", name, err)
	}
	return name, nil
}
