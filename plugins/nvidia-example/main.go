// Command nvidia-example is devicehost's example NVIDIA GPU plugin binary. Drop it in
// the host's plugin dir; see package nvidia for what it does and its config.
package main

import "github.com/devicehost/devicehost/plugins/nvidia-example/nvidia"

func main() { nvidia.Main() }
