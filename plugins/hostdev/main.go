// Command hostdev is devicehost's host-device plugin binary. Drop it in the host's
// plugin dir; see package hostdev for what it does and its config.
package main

import "github.com/devicehost/devicehost/plugins/hostdev/hostdev"

func main() { hostdev.Main() }
