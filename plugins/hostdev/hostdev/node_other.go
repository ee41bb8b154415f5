//go:build !unix

package hostdev

import "io/fs"

// deviceNumbers cannot read device numbers here: the plugin serves no node.
func deviceNumbers(fs.FileInfo) (major, minor uint32, ok bool) { return 0, 0, false }
