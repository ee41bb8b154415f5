package manager

import "github.com/devicehost/devicehost/textline"

// oneLine renders err, which may be an errors.Join of many, on one printable line
// (textline.Line), unbounded: for log values and for errors whose parts are each
// bounded already (validation violations).
func oneLine(err error) string { return textline.Line(err.Error(), 0) }
