//go:build !unix

package main

import "os"

// terminalWidth returns 0 (unknown) where the terminal's size is not asked for.
func terminalWidth(*os.File) int { return 0 }
