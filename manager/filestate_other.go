//go:build !linux

package manager

import "os"

// statFile describes the file at path (symlinks followed), for the plugin dir watcher.
// Off Linux there is no inode or ctime at hand: the size, mtime and mode stand for them.
func statFile(path string) (fileState, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileState{}, err
	}
	mtime := fi.ModTime().UnixNano()
	return fileState{
		id:    fileID{size: fi.Size(), mtime: mtime},
		ctime: mtime,
		mode:  uint32(fi.Mode()),
	}, nil
}

// beingWritten cannot tell off Linux.
func beingWritten(string) (writing, known bool) { return false, false }
