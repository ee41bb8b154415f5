package server

// StreamWorkers is streamWorkers, for the tests of package server_test.
const StreamWorkers = streamWorkers

// MethodGrants is the grant each served method needs.
var MethodGrants = methodGrants
