// The local cluster's DNS: CoreDNS linked with only the plugins its Corefile uses
// (build_corefile in devcluster/lora_devcluster/node.py). CoreDNS's own main links every
// plugin, cloud SDKs included, which several times the cold build time buys nothing the node
// needs. A plugin added to the Corefile must be added here.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() { coremain.Run() }
